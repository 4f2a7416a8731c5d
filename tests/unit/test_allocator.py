from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.errors import ConfigError, PoolFull
from kvpool.pool.node.allocator import OffsetAllocator

MiB = 1 << 20


def test_rounds_offsets_and_sizes_to_alignment() -> None:
    alloc = OffsetAllocator(10_000, alignment=1024)
    assert alloc.capacity == 9 * 1024  # usable capacity rounds down
    a = alloc.allocate(1)
    b = alloc.allocate(1025)
    assert (a, alloc.size_of(a)) == (0, 1024)
    assert (b, alloc.size_of(b)) == (1024, 2048)
    assert alloc.used == 3072
    assert alloc.free_bytes == 6 * 1024
    alloc.check_invariants()


def test_exact_fill_then_pool_full_names_sizes() -> None:
    alloc = OffsetAllocator(16 * MiB, alignment=4096)
    offsets = [alloc.allocate(4 * MiB) for _ in range(4)]
    assert offsets == [0, 4 * MiB, 8 * MiB, 12 * MiB]
    assert alloc.free_bytes == 0 and not alloc.can_allocate(1)
    with pytest.raises(PoolFull, match=r"cannot allocate 4\.0 KiB: largest free extent is 0 B of 16\.0 MiB"):
        alloc.allocate(4096)
    alloc.free(offsets[1])
    before = alloc.stats()
    with pytest.raises(PoolFull) as info:
        alloc.allocate(5 * MiB)
    assert "5.0 MiB" in str(info.value) and "4.0 MiB" in str(info.value) and "16.0 MiB capacity" in str(info.value)
    assert alloc.stats() == before  # nothing changes on failure
    alloc.check_invariants()


def test_pool_full_mentions_alignment_rounding() -> None:
    alloc = OffsetAllocator(8192, alignment=4096)
    alloc.allocate(4096)
    with pytest.raises(PoolFull, match=r"cannot allocate 4\.0 KiB \(8\.0 KiB aligned\)"):
        alloc.allocate(4097)


def test_free_coalesces_both_sides() -> None:
    alloc = OffsetAllocator(3 * 4096)
    a, b, c = (alloc.allocate(4096) for _ in range(3))
    alloc.free(a)
    alloc.free(c)
    assert alloc.stats().free_extents == 2
    alloc.free(b)
    stats = alloc.stats()
    assert (stats.free_extents, stats.largest_free, stats.free, stats.allocations) == (
        1,
        alloc.capacity,
        alloc.capacity,
        0,
    )
    alloc.check_invariants()


def test_double_free_and_unknown_offset_raise() -> None:
    alloc = OffsetAllocator(4 * 4096)
    a = alloc.allocate(4096)
    alloc.free(a)
    with pytest.raises(ValueError, match="not a live allocation"):
        alloc.free(a)
    with pytest.raises(ValueError, match="not a live allocation"):
        alloc.free(123)
    with pytest.raises(ValueError, match="not a live allocation"):
        alloc.size_of(a)
    alloc.check_invariants()


@pytest.mark.parametrize("size", [0, -1, 1.5, "4096", True, None])
def test_bad_size_raises_naming_size(size: Any) -> None:
    alloc = OffsetAllocator(4096)
    with pytest.raises(ValueError, match="size"):
        alloc.allocate(size)
    with pytest.raises(ValueError, match="size"):
        alloc.can_allocate(size)
    assert alloc.used == 0


@pytest.mark.parametrize("capacity", [0, -4096, 4096.0, None, 100])
def test_bad_capacity_raises_naming_capacity(capacity: Any) -> None:
    with pytest.raises(ValueError, match="capacity"):
        OffsetAllocator(capacity, alignment=4096)


@pytest.mark.parametrize("alignment", [0, -4, 3, 4095, 2.0, True])
def test_bad_alignment_raises_naming_alignment(alignment: Any) -> None:
    with pytest.raises(ValueError, match="alignment"):
        OffsetAllocator(1 << 20, alignment=alignment)


def test_claim_takes_a_chosen_free_range_and_refuses_anything_else() -> None:
    a = OffsetAllocator(16 * 4096)
    room = a.allocate(8 * 4096)
    a.free(room)  # a writer's room, carved into chunks
    a.claim(room + 4096, 5000)  # rounded to two blocks
    a.claim(room + 5 * 4096, 4096)
    assert a.used == 3 * 4096 and a.stats().free_extents == 3 and a.allocate(4096) == 0
    for offset, size in ((room + 4096, 1), (room + 2 * 4096, 4096), (15 * 4096, 2 * 4096), (-4096, 1)):
        with pytest.raises(ConfigError):
            a.claim(offset, size)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        a.claim(100, 1)
    a.check_invariants()


def test_fragmentation_visible_in_stats() -> None:
    alloc = OffsetAllocator(8 * 4096)
    offsets = [alloc.allocate(4096) for _ in range(8)]
    assert alloc.stats().fragmentation == 0.0  # full: nothing free
    for off in offsets[::2]:
        alloc.free(off)
    stats = alloc.stats()
    assert (stats.free, stats.largest_free, stats.free_extents) == (4 * 4096, 4096, 4)
    assert stats.fragmentation == pytest.approx(0.75)
    assert alloc.can_allocate(4096) and not alloc.can_allocate(4097)
    alloc.check_invariants()


def _first_free_run(occupied: list[bool], length: int) -> int | None:
    """Index of the first block of the lowest run of ``length`` free blocks, or None."""
    run = 0
    for i, used in enumerate(occupied):
        run = 0 if used else run + 1
        if run == length:
            return i - length + 1
    return None


def _longest_free_run(occupied: list[bool]) -> int:
    best = run = 0
    for used in occupied:
        run = 0 if used else run + 1
        best = max(best, run)
    return best


class AllocatorMachine(RuleBasedStateMachine):
    """Checks ``OffsetAllocator`` against a block-level occupancy model of the segment."""

    @initialize(alignment=st.sampled_from([1, 8, 64]), blocks=st.integers(1, 48), slack=st.integers(0, 63))
    def setup(self, alignment: int, blocks: int, slack: int) -> None:
        self.align = alignment
        self.alloc = OffsetAllocator(blocks * alignment + slack % alignment, alignment=alignment)
        self.occupied = [False] * blocks
        self.live: dict[int, int] = {}  # offset -> blocks

    @rule(size=st.integers(1, 50 * 64))
    def allocate(self, size: int) -> None:
        n = -(-size // self.align)
        expected = _first_free_run(self.occupied, n)
        assert self.alloc.can_allocate(size) == (expected is not None)
        try:
            offset = self.alloc.allocate(size)
        except PoolFull:
            assert expected is None, f"PoolFull but {n} free blocks exist at block {expected}"
            return
        assert offset % self.align == 0
        block = offset // self.align
        assert block == expected  # first fit over coalesced extents == lowest free run
        assert not any(self.occupied[block : block + n])
        self.occupied[block : block + n] = [True] * n
        self.live[offset] = n
        assert self.alloc.size_of(offset) == n * self.align

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        n = self.live.pop(offset)
        self.alloc.free(offset)
        block = offset // self.align
        self.occupied[block : block + n] = [False] * n

    @rule(block=st.integers(0, 50), size=st.integers(1, 8 * 64))
    def claim(self, block: int, size: int) -> None:
        """A chosen range: claimed exactly when every block of it is free and inside the segment."""
        n = -(-size // self.align)
        fits = block + n <= len(self.occupied) and not any(self.occupied[block : block + n])
        if not fits:
            with pytest.raises(ConfigError, match="not free"):
                self.alloc.claim(block * self.align, size)
            return
        self.alloc.claim(block * self.align, size)
        self.occupied[block : block + n] = [True] * n
        self.live[block * self.align] = n

    @rule(offset=st.integers(0, 50 * 64))
    def free_unknown(self, offset: int) -> None:
        if offset in self.live:
            return
        with pytest.raises(ValueError):
            self.alloc.free(offset)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        assert self.alloc.used == sum(self.occupied) * self.align
        assert self.alloc.allocations == len(self.live)
        assert self.alloc.largest_free == _longest_free_run(self.occupied) * self.align

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for offset in list(self.live):
            self.alloc.free(offset)
        self.alloc.check_invariants()
        stats = self.alloc.stats()
        assert (stats.used, stats.allocations, stats.free_extents) == (0, 0, 1)
        assert stats.largest_free == stats.free == self.alloc.capacity


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
