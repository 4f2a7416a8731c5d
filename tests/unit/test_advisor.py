"""The capacity advisor's miss-ratio curve against exact simulations of the same trace: LRU for single accesses,
and per-node LRU with the prefix rule for lookups (the model of the pool): exact without sampling, within a few
points (5) with 10 % SHARDS sampling and with the memory bound forcing the rate down."""

import functools

import numpy as np
import pytest

from kvpool.bench.traces import TraceSettings, make_trace
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.errors import ConfigError
from kvpool.pool.advisor import usable_bytes
from kvpool.pool.config import Watermarks
from kvpool.pool.reuse import MissRatioCurve, ReuseSampler, lru_hit_ratio, prefix_lru_hit_ratio, tier_hits

KIB, MIB = 1 << 10, 1 << 20
Lookups = list[tuple[str, list[tuple[bytes, int]]]]


def zipf_trace(requests: int = 6_000, docs: int = 500, seed: int = 7) -> list[tuple[bytes, int]]:
    """The pool's workload in small: requests for ``docs`` documents of 8-64 chunks (128 KiB each) with Zipf(0.9)
    popularity, each request reading its document's chunks as a prefix (~245,000 accesses)."""
    rng = np.random.default_rng(seed)
    ident = CacheIdentity(model="advisor", kv_dtype="u8", layout="b", chunk_size=1)
    doc_keys = [chunk_keys(ident, [d] * int(n)) for d, n in enumerate(rng.integers(8, 65, docs))]
    popularity = 1 / np.arange(1, docs + 1) ** 0.9
    return [(k, 128 * KIB) for d in rng.choice(docs, requests, p=popularity / popularity.sum()) for k in doc_keys[d]]


@functools.cache
def lane_trace(system_chunks: int = 0) -> Lookups:
    """bench/routing.py's trace in small (80 documents with per-user questions, 60 four-turn conversations; chunks
    of 64 tokens, 64 KiB), as its lanes look it up: request ``i`` on node ``i % 3`` (whose puts make the chunks its
    node's) then again on node ``i + 1`` (the decode worker); ``system_chunks`` of one shared prompt before each."""
    ident = CacheIdentity(model="lanes", kv_dtype="u8", layout="b", chunk_size=64)
    trace = make_trace(TraceSettings(requests=800, documents=80, users=32, conversations=60, seed=1))
    system = list(range(64 * system_chunks))
    out: Lookups = []
    for i, request in enumerate(trace):
        items = [(k, 64 * KIB) for k in chunk_keys(ident, system + request.tokens)]
        out += [(f"node{i % 3}", items), (f"node{(i + 1) % 3}", items)]
    return out


def curve_of(trace: list[tuple[bytes, int]], **kw: float) -> tuple[MissRatioCurve, ReuseSampler]:
    sampler = ReuseSampler(**kw)  # type: ignore[arg-type]
    for key, size in trace:
        sampler.access(key, size)
    return sampler.curve(), sampler


def lookups_curve(lookups: Lookups, **kw: object) -> MissRatioCurve:
    sampler = ReuseSampler(**kw)  # type: ignore[arg-type]
    for node, items in lookups:
        sampler.lookup(items, node)
    return sampler.curve()


CAPACITIES = [128 << 20, 512 << 20, 1 << 30]  #: 1,000 to 8,000 chunks (a 10 % sample resolves ~10 chunks)
PER_NODE = [4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB]  #: 64 to 512 chunks a node, of ~3,000 distinct


def test_without_sampling_the_curve_is_exact_lru() -> None:
    trace = zipf_trace()
    curve, _ = curve_of(trace, rate=1.0, max_keys=100_000)
    for c in CAPACITIES:
        assert curve.hit_ratio(c) == pytest.approx(lru_hit_ratio(trace, c), abs=0.005), c


@pytest.mark.parametrize(("rate", "max_keys"), [(0.1, 100_000), (1.0, 2_000)])
def test_sampled_curves_stay_within_a_few_points(rate: float, max_keys: int) -> None:
    trace = zipf_trace()
    curve, sampler = curve_of(trace, rate=rate, max_keys=max_keys)
    assert len(sampler._last) <= max_keys  # bounded memory, whatever the stream
    for c in CAPACITIES:
        assert abs(curve.hit_ratio(c) - lru_hit_ratio(trace, c)) < 0.05, c


def test_per_node_prefix_curve_is_exact_without_sampling() -> None:
    """Running maxima of per-node distances give, at every capacity, what per-node LRU with the prefix rule does."""
    lookups = lane_trace()
    curve = lookups_curve(lookups, rate=1.0, max_keys=100_000)
    assert curve.nodes == 3  # a pool's capacity is split over the three nodes that put chunks
    for c in PER_NODE:
        exact = prefix_lru_hit_ratio(lookups, {f"node{i}": c for i in range(3)})
        assert curve.hit_ratio(3 * c) == pytest.approx(exact, abs=1e-9), c
    assert curve.ceiling() == pytest.approx(prefix_lru_hit_ratio(lookups, {f"node{i}": 1 << 40 for i in range(3)}))


def test_unequal_nodes_are_normalised_by_their_share() -> None:
    lookups = lane_trace()
    shares = {"node0": 0.5, "node1": 0.25, "node2": 0.25}
    curve = lookups_curve(lookups, rate=1.0, max_keys=100_000, shares=shares)
    for pool in (12 * MIB, 48 * MIB):
        exact = prefix_lru_hit_ratio(lookups, {node: int(pool * share) for node, share in shares.items()})
        assert curve.hit_ratio(pool) == pytest.approx(exact, abs=1e-9), pool


@pytest.mark.parametrize("system_chunks", [0, 1])
def test_sampled_prefix_curves_stay_within_a_few_points(system_chunks: int) -> None:
    """Keys sampled one by one (the running maximum sees a lookup's sampled keys only), with or without a
    system prompt every lookup shares: within 5 points of the exact per-node prefix simulation."""
    lookups = lane_trace(system_chunks)
    for kw in ({"rate": 0.1, "max_keys": 100_000}, {"rate": 1.0, "max_keys": 300}):
        curve = lookups_curve(lookups, **kw)
        for c in PER_NODE[1:]:  # 4 MiB is 64 chunks: too few for a 10 % sample to resolve
            exact = prefix_lru_hit_ratio(lookups, {f"node{i}": c for i in range(3)})
            assert abs(curve.hit_ratio(3 * c) - exact) < 0.05, (kw, c)


def test_the_prefix_rule_only_ever_lowers_the_curve() -> None:
    """A running maximum is at least the distance it includes: reusing a prefix never hits more than objects do."""
    lookups = lane_trace()
    prefix = lookups_curve(lookups, rate=1.0, max_keys=100_000)
    objects = lookups_curve([(n, [item]) for n, items in lookups for item in items], rate=1.0, max_keys=100_000)
    assert all(prefix.hit_ratio(3 * c) <= objects.hit_ratio(3 * c) for c in PER_NODE)
    assert any(prefix.hit_ratio(3 * c) < objects.hit_ratio(3 * c) for c in PER_NODE)


def test_keys_being_written_by_a_concurrent_lookup_miss_at_every_capacity() -> None:
    """A key found not held although it fits the capacity the lookups ran at was being written (a concurrent
    lookup missed it first): a miss at any capacity.  One found not held beyond it was evicted: a larger pool
    would have held it."""
    a, b, c = (bytes([i]) * 32 for i in range(3))
    lookups = [("n", [(a, 10)]), ("n", [(a, 10)]), ("n", [(b, 10)]), ("n", [(c, 10)]), ("n", [(a, 10)])]
    unheld = [{0}, {0}, {0}, {0}, {0}]  # the second lookup of a raced the first; the last found a evicted
    sampler = ReuseSampler(1.0, 100, logged_at=20)
    for (node, items), missing in zip(lookups, unheld, strict=True):
        sampler.lookup(items, node, missing)
    curve = sampler.curve()
    assert curve.hit_ratio(20) == 0.0  # as logged: nothing held
    assert curve.hit_ratio(30) == pytest.approx(1 / 5)  # a pool of three keys keeps a for the last lookup
    assert curve.ceiling() == pytest.approx(1 / 5)  # never the raced one
    with pytest.raises(ConfigError):
        ReuseSampler(logged_at=-1)


def test_tiers_split_the_hits_and_a_codec_stretches_nvme() -> None:
    curve, _ = curve_of(zipf_trace(), rate=1.0, max_keys=100_000)
    plain, packed = tier_hits(curve, 128 << 20, 128 << 20), tier_hits(curve, 128 << 20, 128 << 20, nvme_ratio=4.0)
    assert plain.dram == packed.dram == pytest.approx(curve.hit_ratio(128 << 20))
    assert plain.dram + plain.nvme == pytest.approx(curve.hit_ratio(256 << 20))
    assert packed.nvme > plain.nvme and packed.recomputed < plain.recomputed
    assert curve.ceiling() >= curve.hit_ratio(1 << 40) > 0.5


def test_dram_above_nvme_holds_chunks_between_its_watermarks() -> None:
    assert usable_bytes(100.0, 50.0) == pytest.approx((70.0, 50.0))  # default watermarks 0.6 / 0.8
    assert usable_bytes(100.0, 50.0, Watermarks(high=0.9, low=0.5)) == pytest.approx((70.0, 50.0))
    assert usable_bytes(100.0, 0.0) == (100.0, 0.0)  # no NVMe below: DRAM fills, then evicts


def test_bad_settings_are_config_errors() -> None:
    for kw in ({"rate": 0}, {"rate": 1.5}, {"max_keys": 0}, {"rate": True}, {"shares": {"n": 0}}):
        with pytest.raises(ConfigError):
            ReuseSampler(**kw)  # type: ignore[arg-type]
