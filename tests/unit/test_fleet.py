"""The fleet simulator (bench/fleet*.py): trace keys, the simulated node over the pool's real store, the fleet's
lookups, routing, tiers and counts, the cost table's arithmetic."""

import io
import sys
from collections import Counter

import pytest
from rich.console import Console

from kvpool.bench import fleet, fleet_cost, fleet_report
from kvpool.bench.fleet_node import Byteless, SimNode, put, read
from kvpool.bench.fleet_sim import Fleet, FleetResult, FleetSettings, replay
from kvpool.bench.workloads.mooncake import (
    Request,
    block_tokens,
    ceiling,
    load,
    prefix_hit_rate,
    request_keys,
    trace_path,
)
from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.pool.client.writes import Rooms
from kvpool.pool.config import Watermarks

CHUNK = 4096  #: bytes of a test chunk: one page
TOKENS = 16


def request(t_s: float, ids: tuple[int, ...], copy: int = 0) -> Request:
    return Request(t_s, len(ids) * TOKENS, 1, ids, request_keys(ids, TOKENS, TOKENS, copy), copy)


def settings(**kw: object) -> FleetSettings:
    base = {"nodes": 2, "dram_tokens": 64, "chunk_tokens": TOKENS, "token_bytes": CHUNK // TOKENS}
    return FleetSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_equal_ids_give_equal_keys_and_a_shared_prefix_shares_exactly_its_keys() -> None:
    assert (block_tokens(7, 16) == block_tokens(7, 16)).all() and not (block_tokens(7, 16) == block_tokens(8, 16)).any()
    a, b = request_keys((1, 2, 3), TOKENS, TOKENS), request_keys((1, 2, 4), TOKENS, TOKENS)
    assert a[:2] == b[:2] and a[2] != b[2] and len(set(a + b)) == 4
    assert len(request_keys((1, 2), 32, 16)) == 4  # two chunks a block
    assert request_keys((1, 2), TOKENS, TOKENS, copy=1)[0] != a[0]  # another tenant's copy: other keys
    with pytest.raises(ConfigError):
        load("conversation", limit=1, tokens_per_block=16, chunk_tokens=12)


@pytest.mark.skipif(not trace_path("conversation").exists(), reason="the Mooncake traces are not here")
def test_the_trace_keys_reuse_what_its_ids_reuse() -> None:
    requests = load("conversation", limit=300, tokens_per_block=TOKENS, chunk_tokens=TOKENS)
    assert ceiling(requests) == prefix_hit_rate(r.hash_ids for r in requests) > 0  # keys reuse as the ids do
    assert [r.t_s for r in requests] == sorted(r.t_s for r in requests)
    assert len(load("conversation", limit=10, copies=3, tokens_per_block=TOKENS, chunk_tokens=TOKENS)) == 30


def node(dram_chunks: int, nvme_chunks: int = 0) -> SimNode:
    marks = Watermarks(high=0.8, low=0.5)
    return SimNode("node-0000", dram_chunks * CHUNK, nvme_chunks * CHUNK, ManualClock(), watermarks=marks)


def test_a_simulated_node_is_the_pools_store_with_no_bytes() -> None:
    n = node(8)
    keys = request_keys(tuple(range(20)), TOKENS, TOKENS)
    rooms = Rooms()
    put(rooms, n, keys[:6], CHUNK)
    read(n, n, keys[:1], Tier.DRAM)  # keys[0] is now the most recently used
    put(rooms, n, keys[6:12], CHUNK)
    held = [k for k in keys if k in n.store]
    assert keys[0] in held and keys[1] not in held and len(held) <= 8  # LRU, the client's held room counted
    assert n.store.audit() == []
    assert isinstance(n.store.segments[Tier.DRAM], Byteless)


def test_dram_above_its_high_watermark_moves_to_nvme_and_a_read_promotes_it_back() -> None:
    n, m = node(10, 40), node(10)
    keys = request_keys(tuple(range(30)), TOKENS, TOKENS)
    rooms = Rooms()
    for i in range(0, 30, 3):
        put(rooms, n, keys[i : i + 3], CHUNK)
    first = n.store.held(keys[0])
    assert first is not None and first.tier is Tier.NVME and len(n.store.chunks()) == 30
    read(m, n, keys[:1], Tier.NVME)  # a peer's read: prepare_load promotes it
    promoted = n.store.held(keys[0])
    assert promoted is not None and promoted.tier is Tier.DRAM
    assert n.store.counters["promotions"] == 1 and n.store.audit() == []


def test_the_global_pool_reads_what_another_node_put_and_local_caches_do_not() -> None:
    reqs = [request(0.0, (1, 2, 3)), request(1.0, (1, 2, 3, 4)), request(2.0, (1, 2, 3, 4, 5))]
    shared = replay(reqs, settings(policy="round-robin"))
    local = replay(reqs, settings(policy="round-robin", shared=False))
    assert shared.hits == 3 + 4 and shared.hits_by_path == Counter({"peer": 4, "dram": 3})
    assert local.hits == 3  # the third request, back on the first node
    assert shared.chunks == local.chunks == 12
    assert shared.published["added"] == shared.counters["puts"] == 5
    assert shared.links["read DRAM (peer)"] == 4 * CHUNK and shared.peer_out == Counter(
        {"node-0000": 3 * CHUNK, "node-0001": CHUNK}
    )
    cache_aware = replay(reqs, settings(shared=False))  # the local caches' prefix-aware scheduler follows the prefix
    assert cache_aware.hits == 7


def test_an_infinite_pool_reaches_the_ceiling_and_prefill_time_falls_by_the_reuse() -> None:
    reqs = [request(float(i), (1, 2, 3, 10 + i)) for i in range(10)]
    r = replay(reqs, settings(dram_tokens=10_000))
    assert r.hit_rate == ceiling(reqs) == 27 / 40
    assert 0.6 < r.saved < 27 / 40  # the last token of a prompt is always computed; reloads cost a little
    assert r.requests == 10 and r.span_s == 9.0


def test_idle_nvme_chunks_go_to_s3_and_are_read_from_there_once_dropped() -> None:
    s = settings(nodes=1, dram_tokens=4 * TOKENS, nvme_tokens=4 * TOKENS, s3=True, flush_after_s=5, flush_every_s=1)
    fleet_ = Fleet(s)
    fleet_.serve(request(0.0, (1, 2, 3, 4, 5, 6)))  # more than DRAM: some go down to NVMe
    for i in range(10):
        fleet_.serve(request(10.0 + i, (100 + 3 * i, 101 + 3 * i, 102 + 3 * i)))  # pushes them out of NVMe
    r = fleet_.result
    assert r.published["s3"] > 0 and r.links["flush NVMe->S3"] == r.published["s3"] * CHUNK
    fleet_.serve(request(30.0, (1, 2)))
    assert r.hits_by_path["remote"] >= 1
    assert all(n.store.audit() == [] for n in fleet_.nodes)


def test_the_cost_row_prices_each_change_by_the_pools_own_encoders() -> None:
    sizes = fleet_cost.record_bytes()
    assert 100 < sizes["placement"] < 400 and sizes["drop"] > sizes["tombstone"] > 0
    r = FleetResult(settings(), requests=10, first_s=0.0, last_s=10.0, held_chunks=5)
    r.published.update(added=100, dropped=50)
    r.links.update({"read DRAM (peer)": 2000})
    row = fleet_cost.cost_row(4, r)
    assert row["placements_s"] == 15 and row["watch_events_per_client_s"] == 20
    assert row["etcd_write_bytes_s"] == (100 * sizes["placement"] + 50 * sizes["drop"]) / 10
    assert row["link_bytes_s_per_node"] == {"read DRAM (peer)": 50.0}
    assert row["etcd_cpu_cores"][0] == 20 * 4 * fleet_cost.MEASURED.etcd_us_per_event_per_watch[0] / 1e6


def test_the_paper_part_replays_figure_10s_setup_beside_the_fleet_run_and_quotes_the_paper_exactly() -> None:
    reqs = [request(0.0, (1, 2, 3)), request(1.0, (1, 2, 3, 4)), request(2.0, (1, 2, 3, 4, 5))]
    printed = io.StringIO()
    console = Console(file=printed, width=400)
    rows = fleet.paper_rows(fleet.Runner(console), "conversation", reqs, settings())
    fig10 = [r for r in rows if r["setup"] == fleet_report.PAPER_SETUP]
    assert [(r["nodes"], r["dram_tokens"]) for r in fig10] == [(10, 3_000_000)] * 2 + [(1, 3_000_000)]
    assert {r["nodes"] for r in rows if r not in fig10} == {2} and len(rows) == len(fig10) + 7
    local, pool, one = fig10
    assert (local["config"], pool["config"]) == (fleet_report.LOCAL, fleet_report.GLOBAL)
    assert pool["hit_rate"] == one["hit_rate"] == ceiling(reqs) and pool["prefill_s"] > 0
    out = {
        "paper": rows,
        "sweep": [],
        "nvme": [],
        "ceiling": {"conversation": {"replayed": ceiling(reqs), "readme": 0}},
    }
    fleet_report.render(out, console)
    text = printed.getvalue()
    quoted = ("16.9 %", "37.5 %", "2.22x", "0.76x", "41 %", "26.4 %", "62.2 %", "2.36x", "0.52x", "46 %")
    assert all(f in text for f in quoted) and "tool & agent (trace not shipped)" in text
    assert "2.38" not in text and "10 nodes x 3M tokens" in text and "not the paper's Fig. 10 setup" in text


def test_the_bench_has_a_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["fleet.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        fleet.main()
    assert exit_.value.code == 0 and "--parts" in capsys.readouterr().out
