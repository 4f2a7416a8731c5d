import pytest

from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.pool.config import Watermarks
from kvpool.pool.eviction import EvictionPolicy


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_lru_order_follows_accesses_and_skips_pinned() -> None:
    clock = ManualClock()
    p = EvictionPolicy(clock)
    for i in range(4):
        p.add(key(i), Tier.DRAM, 10)
        clock.advance(1)
    p.touch(key(0))
    assert list(p.lru(Tier.DRAM)) == [key(1), key(2), key(3), key(0)]
    p.pin(key(2))
    p.pin(key(2))
    assert key(2) not in list(p.lru(Tier.DRAM))
    p.unpin(key(2))
    assert key(2) not in list(p.lru(Tier.DRAM))  # still pinned once
    p.unpin(key(2))
    assert list(p.lru(Tier.DRAM))[1] == key(2)
    with pytest.raises(ValueError, match="not pinned"):
        p.unpin(key(2))


def test_ties_on_the_clock_break_by_access_order() -> None:
    p = EvictionPolicy(ManualClock())  # the clock never moves
    for i in range(3):
        p.add(key(i), Tier.DRAM, 1)
    p.touch(key(0))
    assert list(p.lru(Tier.DRAM)) == [key(1), key(2), key(0)]


def test_move_keeps_recency_and_tiers_are_separate() -> None:
    clock = ManualClock()
    p = EvictionPolicy(clock)
    p.add(key(0), Tier.NVME, 5)
    clock.advance(1)
    p.add(key(1), Tier.DRAM, 7)
    clock.advance(1)
    p.add(key(2), Tier.NVME, 5)
    p.move(key(1), Tier.NVME)
    assert list(p.lru(Tier.NVME)) == [key(0), key(1), key(2)]
    assert list(p.lru(Tier.DRAM)) == []
    assert p.count(Tier.NVME) == 3


def test_drop_order_prefers_chunks_with_a_copy_elsewhere() -> None:
    clock = ManualClock()
    p = EvictionPolicy(clock)
    for i in range(4):
        p.add(key(i), Tier.NVME, 1, replicated=i in (2, 3))
        clock.advance(1)
    assert list(p.drop_order(Tier.NVME)) == [key(2), key(3), key(0), key(1)]


def test_unknown_and_duplicate_keys() -> None:
    p = EvictionPolicy()
    p.add(key(1), Tier.DRAM, 1)
    with pytest.raises(ValueError, match="already tracked"):
        p.add(key(1), Tier.NVME, 1)
    with pytest.raises(KeyError):
        p.touch(key(2))


@pytest.mark.parametrize("low,high", [(0.8, 0.8), (0.9, 0.8), (0, 0.5), (0.5, 1.5)])
def test_bad_watermarks(low: float, high: float) -> None:
    with pytest.raises(ConfigError, match="watermarks"):
        Watermarks(high=high, low=low)
