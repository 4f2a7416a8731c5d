"""The router's choice of upstream (kvpool/prefill_decode/front/upstream.py), as pure logic: each policy, the
prefix-aware policy's memory and its limit on skew, and what it reads of a request body.  (Through a real vLLM
server: tests/integration/engine/test_openai_server.py.)"""

from pathlib import Path
from typing import Any

import pytest

from kvpool.core.net import free_port
from kvpool.errors import ConfigError
from kvpool.metadata.zmq_events import BlockRemoved, BlockStored, KVEventBatch
from kvpool.prefill_decode.front.engine_prefixes import EnginePrefixes, events_flag, tokenizer, topic
from kvpool.prefill_decode.front.upstream import Picker, prefix_blocks, prompt_text, render_metrics, route_config

URLS = ["http://127.0.0.2:8001", "http://127.0.0.3:8001", "http://127.0.0.4:8001"]
A, B = "a" * 64 + "the first question", "b" * 64 + "another one"


def picker(policy: str, **settings: Any) -> Picker:
    return Picker(route_config(URLS, policy, block_chars=16, **settings))


def test_round_robin_takes_each_in_turn_and_least_loaded_the_idlest() -> None:
    rr = picker("round-robin")
    assert [rr.pick(A) for _ in range(4)] == [0, 1, 2, 0]
    ll = picker("least-loaded")
    first, second = ll.pick(A), ll.pick(A)
    assert (first, second, ll.pick(A)) == (0, 1, 2)
    ll.done(second)
    assert ll.pick(B) == second and [u.in_flight for u in ll.upstreams] == [1, 1, 1]


def test_prefix_aware_follows_the_longest_prefix_sent_and_balances_the_rest() -> None:
    p = picker("prefix-aware")
    a = p.pick(A)
    p.done(a)
    b = p.pick(B)  # nothing of B was sent anywhere: the least loaded
    assert b != a
    p.done(b)
    assert p.pick(A[:48] + "a follow-up sharing three blocks") == a  # its first 3 blocks went to a
    assert p.upstreams[a].matched_blocks == 3 and p.upstreams[a].prompt_blocks == 5 + 5


def test_prefix_aware_leaves_an_upstream_busier_than_max_skew() -> None:
    p = picker("prefix-aware", max_skew=1)
    a = p.pick(A)
    assert p.pick(A) == a  # 1 in flight there, 0 elsewhere: within the skew
    assert p.pick(A) != a  # 2 beyond the least loaded: it goes elsewhere


def test_prefix_aware_remembers_capacity_blocks_per_upstream() -> None:
    p = picker("prefix-aware", capacity=4)
    a = p.pick(A)  # 5 blocks: the first is forgotten at once, and a chain matches from the first
    p.done(a)
    assert len(p.upstreams[a].seen) == 4
    p.pick(A)
    assert p.upstreams[a].matched_blocks == 0


def test_prompt_blocks_chain_so_a_block_matches_only_after_the_same_prefix() -> None:
    x, y = prefix_blocks("a" * 32, 16), prefix_blocks("b" * 16 + "a" * 16, 16)
    assert len(x) == 2 and x[1] != y[1] and prefix_blocks("short", 16) == []


def test_what_the_router_reads_of_a_body_and_what_it_refuses() -> None:
    assert prompt_text({"prompt": "hi"}) == "hi" and prompt_text({"prompt": [1, 2]}) == "[1,2]"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert prompt_text(chat) == "system: be brief\nuser: hi"
    assert route_config([URLS[0], URLS[0] + "/"], "round-robin").upstreams == (URLS[0],)  # one server, named twice
    for bad, match in (
        ([], "at least one --upstream http://host:port"),
        (["127.0.0.1:80"], "must be http://host:port"),
    ):
        with pytest.raises(ConfigError, match=match):
            route_config(bad, "round-robin")
    with pytest.raises(ConfigError, match="round-robin, least-loaded, prefix-aware"):
        route_config(URLS, "random")


def test_metrics_name_each_upstream() -> None:
    p = picker("prefix-aware")
    p.done(p.pick(A), failed=True)
    text = render_metrics(p)
    assert f'kvpool_route_requests_total{{upstream="{URLS[0]}",policy="prefix-aware"}} 1' in text
    assert f'kvpool_route_errors_total{{upstream="{URLS[0]}",policy="prefix-aware"}} 1' in text
    assert "# TYPE kvpool_route_in_flight gauge" in text


def test_an_upstream_that_refused_a_connection_is_left_out_for_down_s() -> None:
    for policy in ("round-robin", "least-loaded", "prefix-aware"):
        p = picker(policy, down_s=5.0)
        p.down(1, now=100.0)
        picks = [p.pick(A, now=101.0) for _ in range(4)]
        assert 1 not in picks, policy
        assert p.pick(A, now=101.0, skip=frozenset({0, 2})) == 1  # the others refused this request too: try it
        for i in range(3):
            p.down(i, now=100.0)
        assert p.pick(A, now=102.0) in (0, 1, 2)  # every one down: still one of them
        for j in range(len(p.upstreams)):
            p.done(j, failed=False)
        assert 1 in [p.pick(f"{i}" * 64, now=105.0) for i in range(3)], policy  # back after down_s


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, 4, None, "GPU", None)


def test_prefix_aware_with_kv_events_follows_what_each_engine_holds_not_what_it_was_sent() -> None:
    """The engines' own KV events (blocks of 4 tokens here) say which engine holds a prompt's prefix: one that was
    never sent it through the router (it came another way) takes it; once its engine evicted the blocks, the
    router balances load again, though it had been sent that prompt."""
    endpoint = f"tcp://127.0.0.2:{free_port('127.0.0.2')}"
    config = route_config(URLS, "prefix-aware", kv_events=endpoint, tokenizer="unused")
    engines = EnginePrefixes(endpoint, len(URLS), tokenize=lambda body: body["prompt"])
    p = Picker(config, engines)
    try:
        asked = engines.asked({"prompt": list(range(10))})
        assert asked is not None and asked.chain == ()  # no block size known yet: nothing to compare
        assert p.pick("", asked=asked) == 0  # nothing held anywhere: the least loaded
        p.done(0, asked=asked)
        engines.events.apply(topic(2), 0, KVEventBatch(0.0, [stored([1, 2], None, list(range(8)))]))
        asked = engines.asked({"prompt": list(range(10))})
        assert asked is not None and len(asked.chain) == 2
        assert p.pick("", asked=asked) == 2  # engine 2 holds two of its blocks
        assert (p.upstreams[2].matched_blocks, p.upstreams[2].prompt_blocks) == (2, 2)
        p.done(2, asked=asked)
        engines.events.apply(topic(2), 1, KVEventBatch(0.0, [BlockRemoved([1], "GPU")]))
        assert p.pick("", asked=asked) == 1  # evicted there: the least loaded (ties: the one that took fewest)
        text = render_metrics(p)
        assert 'kvpool_route_kv_events_total{policy="prefix-aware"} 2' in text
        assert 'kvpool_route_kv_event_gaps_total{policy="prefix-aware"} 0' in text
    finally:
        engines.close()


def test_a_prompt_in_flight_on_an_engine_counts_as_held_there_until_answered() -> None:
    """A conversation's next turn that comes while the last is still computing follows it (its blocks are not
    stored, so no event says so yet); once answered, only the engine's events count.  A salted prompt shares no
    block with an unsalted one."""
    endpoint = f"tcp://127.0.0.2:{free_port('127.0.0.2')}"
    engines = EnginePrefixes(endpoint, len(URLS), tokenize=lambda body: body["prompt"])
    p = Picker(route_config(URLS, "prefix-aware", kv_events=endpoint, tokenizer="unused"), engines)
    try:
        engines.events.apply(topic(0), 0, KVEventBatch(0.0, [stored([9], None, [90, 91, 92, 93])]))  # block size 4
        first = engines.asked({"prompt": list(range(12))})
        turn = engines.asked({"prompt": [*range(12), 12, 13, 14, 15]})
        salted = engines.asked({"prompt": [*range(12), 12, 13, 14, 15], "cache_salt": "acme"})
        assert first is not None and turn is not None and salted is not None
        busy = p.pick("", asked=engines.asked({"prompt": [7] * 8}))  # upstream 0 busy with something else
        chosen = p.pick("", asked=first)
        assert chosen != busy
        assert p.pick("", asked=turn) == chosen  # 3 of its 4 blocks are in flight there
        assert p.upstreams[chosen].matched_blocks == 3
        assert p.pick("", asked=salted) != chosen  # its blocks hash apart: the least loaded
        p.done(chosen, asked=first)
        p.done(chosen, asked=turn)
        assert engines.held(turn) == ([0, 0, 0], 4)  # answered, and no event stored them: held nowhere
    finally:
        engines.close()


def test_kv_events_need_a_tokenizer_and_the_prefix_aware_policy(tmp_path: Path) -> None:
    where = "tcp://127.0.0.2:5557"
    with pytest.raises(ConfigError, match="give --tokenizer the engines' model directory"):
        route_config(URLS, "prefix-aware", kv_events=where)
    with pytest.raises(ConfigError, match="--kv-events feeds the prefix-aware policy, not round-robin"):
        route_config(URLS, "round-robin", kv_events=where, tokenizer="m")
    with pytest.raises(ConfigError, match="must be tcp://host:port"):
        route_config(URLS, "prefix-aware", kv_events="udp://x:1", tokenizer="m")
    with pytest.raises(ConfigError, match="no tokenizer there"):
        tokenizer(str(tmp_path))
    assert "'topic': " not in events_flag(where, 1) and '"topic": "engine1"' in events_flag(where, 1)
