"""The router's choice of upstream (kvpool/prefill_decode/front/upstream.py), as pure logic: each policy, the
prefix-aware policy's memory and its limit on skew, and what it reads of a request body.  (Through a real vLLM
server: tests/integration/engine/test_openai_server.py.)"""

from typing import Any

import pytest

from kvpool.errors import ConfigError
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
