"""The capacity advisor's miss-ratio curve against an exact LRU simulation of the same trace: exact without
sampling, within a few points (5) with 10 % SHARDS sampling and with the memory bound forcing the rate to 1/16."""

import numpy as np
import pytest

from kvpool.errors import ConfigError
from kvpool.pool.advisor import MissRatioCurve, ReuseSampler, lru_hit_ratio, tier_hits
from kvpool.pool.keys import CacheIdentity, chunk_keys

KIB = 1 << 10


def zipf_trace(requests: int = 6_000, docs: int = 500, seed: int = 7) -> list[tuple[bytes, int]]:
    """The pool's workload in small: requests for ``docs`` documents of 8-64 chunks (128 KiB each) with Zipf(0.9)
    popularity, each request reading its document's chunks as a prefix (~245,000 accesses)."""
    rng = np.random.default_rng(seed)
    ident = CacheIdentity(model="advisor", kv_dtype="u8", layout="b", chunk_size=1)
    doc_keys = [chunk_keys(ident, [d] * int(n)) for d, n in enumerate(rng.integers(8, 65, docs))]
    popularity = 1 / np.arange(1, docs + 1) ** 0.9
    return [(k, 128 * KIB) for d in rng.choice(docs, requests, p=popularity / popularity.sum()) for k in doc_keys[d]]


def curve_of(trace: list[tuple[bytes, int]], **kw: float) -> tuple[MissRatioCurve, ReuseSampler]:
    sampler = ReuseSampler(**kw)  # type: ignore[arg-type]
    for key, size in trace:
        sampler.access(key, size)
    return sampler.curve(), sampler


CAPACITIES = [128 << 20, 512 << 20, 1 << 30]  #: 1,000 to 8,000 chunks (a 10 % sample resolves ~10 chunks)


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


def test_tiers_split_the_hits_and_a_codec_stretches_nvme() -> None:
    curve, _ = curve_of(zipf_trace(), rate=1.0, max_keys=100_000)
    plain, packed = tier_hits(curve, 128 << 20, 128 << 20), tier_hits(curve, 128 << 20, 128 << 20, nvme_ratio=4.0)
    assert plain.dram == packed.dram == pytest.approx(curve.hit_ratio(128 << 20))
    assert plain.dram + plain.nvme == pytest.approx(curve.hit_ratio(256 << 20))
    assert packed.nvme > plain.nvme and packed.recomputed < plain.recomputed
    assert curve.ceiling() >= curve.hit_ratio(1 << 40) > 0.5


def test_bad_settings_are_config_errors() -> None:
    for kw in ({"rate": 0}, {"rate": 1.5}, {"max_keys": 0}, {"rate": True}):
        with pytest.raises(ConfigError):
            ReuseSampler(**kw)  # type: ignore[arg-type]
