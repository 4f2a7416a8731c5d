from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.pool.config import Watermarks
from kvpool.pool.node.eviction import EvictionPolicy
from kvpool.pool.node.recency import RecencyIndex


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


class SetClock:
    """A wall clock a test sets, backwards too (NTP can step it back)."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


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
    with pytest.raises(ConfigError, match=r"(?i)watermarks"):
        Watermarks(high=high, low=low)


def test_a_chunk_marked_replicated_is_dropped_first_and_keeps_its_recency() -> None:
    clock = ManualClock()
    p = EvictionPolicy(clock)
    for i in range(3):
        p.add(key(i), Tier.NVME, 1)
        clock.advance(1)
    p.mark_replicated(key(2))
    assert list(p.drop_order(Tier.NVME)) == [key(2), key(0), key(1)]
    assert list(p.lru(Tier.NVME)) == [key(0), key(1), key(2)]
    p.check_invariants()


def test_lru_reads_as_it_goes_so_pinning_each_victim_takes_only_it_out() -> None:
    """The shape of ``moves.demotions``: each key the walk yields is pinned (begun moving) before the next."""
    clock = ManualClock()
    p = EvictionPolicy(clock)
    for i in range(5):
        p.add(key(i), Tier.DRAM, 1, replicated=i % 2 == 0)
        clock.advance(1)
    walked = []
    for k in p.lru(Tier.DRAM):
        p.pin(k)
        walked.append(k)
    assert walked == [key(i) for i in range(5)] and list(p.lru(Tier.DRAM)) == []
    assert p.count(Tier.DRAM) == 5  # pinned chunks are still counted
    p.check_invariants()


def test_a_chunk_touched_before_a_walk_comes_at_its_new_place_unless_pinned_meanwhile() -> None:
    """A touch leaves the chunk's entry where it was: the walk finds it there and takes it to its recency."""
    clock = ManualClock()
    p = EvictionPolicy(clock)
    for i in range(4):
        p.add(key(i), Tier.DRAM, 1)
        clock.advance(1)
    p.touch(key(1))
    p.touch(key(2))
    walk = p.lru(Tier.DRAM)
    assert next(walk) == key(0)
    assert next(walk) == key(3)  # 1 and 2 passed at their old places, they come after 3
    p.pin(key(1))
    p.remove(key(2))
    assert list(walk) == []
    assert list(p.lru(Tier.DRAM)) == [key(0), key(3)]
    p.check_invariants()


def test_a_touch_with_the_clock_stepped_back_puts_the_chunk_first() -> None:
    clock = SetClock()
    p = EvictionPolicy(clock)
    for i in range(3):
        p.add(key(i), Tier.NVME, 1)
        clock.now += 1
    clock.now -= 10
    p.touch(key(2))
    assert list(p.lru(Tier.NVME)) == [key(2), key(0), key(1)]
    assert next(p.drop_order(Tier.NVME)) == key(2)
    p.check_invariants()


# -- the policy against a brute-force model: a sort of the tier for every question ---------------------------------


@dataclass
class Model:
    tier: Tier
    size: int
    last_access: float
    seq: int
    pins: int
    replicated: bool
    tenant: str


Entry = tuple[float, int, bytes]
KEYS = st.sampled_from([key(i) for i in range(12)])
TIERS = st.sampled_from([Tier.DRAM, Tier.NVME])
TENANTS = st.sampled_from(["", "acme", "globex"])


class LruMachine(RuleBasedStateMachine):
    """``EvictionPolicy`` against ``Model`` records sorted afresh for every question: the same victims in the same
    order, for random adds, touches, moves, pins, copies elsewhere, removes and clock steps (back, too)."""

    @initialize(slack=st.integers(0, 3))
    def setup(self, slack: int) -> None:
        self.clock = SetClock()
        self.policy = EvictionPolicy(self.clock)
        self.policy._order = RecencyIndex(slack)  # rebuild heaps after a few stale entries: the machine gets there
        self.model: dict[bytes, Model] = {}
        self.seq = 0

    # -- the brute-force answers ------------------------------------------------------------------------

    def entries(self, tier: Tier, tenant: str | None = None) -> list[Entry]:
        return sorted(
            (m.last_access, m.seq, k)
            for k, m in self.model.items()
            if m.tier is tier and not m.pins and (tenant is None or m.tenant == tenant)
        )

    def lru(self, tier: Tier, tenant: str | None = None) -> list[bytes]:
        return [k for _, _, k in self.entries(tier, tenant)]

    def drop_order(self, tier: Tier) -> list[bytes]:
        order = self.lru(tier)
        return [k for k in order if self.model[k].replicated] + [k for k in order if not self.model[k].replicated]

    def over_quota(self, quotas: dict[str, tuple[int, int]], tier: Tier) -> list[bytes]:
        out: list[bytes] = []
        for tenant, limits in quotas.items():
            limit = limits[0 if tier is Tier.DRAM else 1]
            excess = sum(m.size for m in self.model.values() if m.tenant == tenant and m.tier is tier) - limit
            for k in self.lru(tier, tenant) if limit else []:
                if excess <= 0:
                    break
                out.append(k)
                excess -= self.model[k].size
        return out

    # -- changes, made to both ----------------------------------------------------------------------------

    def stamp(self) -> tuple[float, int]:
        self.seq += 1  # the model's own sequence: only its order matters
        return self.clock.now, self.seq

    def change(self, what: str, k: bytes, tier: Tier, size: int, flag: bool, tenant: str) -> None:
        m = self.model.get(k)
        if what == "add":
            if m is not None:
                with pytest.raises(ConfigError, match="already tracked"):
                    self.policy.add(k, tier, size, replicated=flag, tenant=tenant)
                return
            self.policy.add(k, tier, size, replicated=flag, tenant=tenant)
            self.model[k] = Model(tier, size, *self.stamp(), 0, flag, tenant)
        elif m is None:
            with pytest.raises(KeyError):
                self.policy.move(k, tier) if what == "move" else getattr(self.policy, what)(k)
        elif what == "touch":
            self.policy.touch(k)
            m.last_access, m.seq = self.stamp()
        elif what == "move":
            self.policy.move(k, tier, size if flag else None)
            m.tier, m.size = tier, size if flag else m.size
        elif what == "mark_replicated":
            self.policy.mark_replicated(k)
            m.replicated = True
        elif what == "pin":
            self.policy.pin(k)
            m.pins += 1
        elif what == "unpin" and not m.pins:
            with pytest.raises(ConfigError, match="not pinned"):
                self.policy.unpin(k)
        elif what == "unpin":
            self.policy.unpin(k)
            m.pins -= 1
        elif what == "remove":
            gone = self.policy.remove(k)
            assert (gone.tier, gone.size, gone.last_access, gone.pins) == (m.tier, m.size, m.last_access, m.pins)
            del self.model[k]

    CHANGES = st.sampled_from(["add", "add", "touch", "touch", "move", "mark_replicated", "pin", "unpin", "remove"])

    @rule(k=KEYS, tier=TIERS, size=st.integers(1, 9), replicated=st.booleans(), tenant=TENANTS)
    def add(self, k: bytes, tier: Tier, size: int, replicated: bool, tenant: str) -> None:
        self.change("add", k, tier, size, replicated, tenant)

    def some_key(self, data: st.DataObject) -> bytes:
        """Mostly a chunk the policy tracks, now and then one it does not."""
        held = sorted(self.model)
        return data.draw(st.sampled_from(held) if held and data.draw(st.integers(0, 9)) < 9 else KEYS)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        self.change("touch", self.some_key(data), Tier.DRAM, 1, False, "")

    @rule(data=st.data(), tier=TIERS, size=st.integers(1, 9), resized=st.booleans())
    def move(self, data: st.DataObject, tier: Tier, size: int, resized: bool) -> None:
        self.change("move", self.some_key(data), tier, size, resized, "")

    @rule(what=st.sampled_from(["pin", "unpin", "mark_replicated", "remove"]), data=st.data())
    def another_change(self, what: str, data: st.DataObject) -> None:
        self.change(what, self.some_key(data), Tier.DRAM, 1, False, "")

    @rule(step=st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0, -1.0, -4.0]))
    def the_clock_moves(self, step: float) -> None:
        self.clock.now += step  # 0: ties, broken by access order; < 0: a wall clock stepped back

    # -- questions ------------------------------------------------------------------------------------------

    @rule(tier=TIERS, tenant=st.none() | TENANTS)
    def whole_orders(self, tier: Tier, tenant: str | None) -> None:
        assert list(self.policy.lru(tier, tenant)) == self.lru(tier, tenant)
        assert list(self.policy.drop_order(tier)) == self.drop_order(tier)

    @rule(tier=TIERS, quotas=st.dictionaries(TENANTS, st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=3))
    def quotas(self, tier: Tier, quotas: dict[str, tuple[int, int]]) -> None:
        assert self.policy.over_quota(quotas, tier) == self.over_quota(quotas, tier)

    @rule(tier=TIERS, n=st.integers(1, 6), replicas_first=st.booleans())
    def evict_one_at_a_time(self, tier: Tier, n: int, replicas_first: bool) -> None:
        """The store's ``_allocate``: ask for one victim, drop it, ask again."""
        for _ in range(n):
            order = self.drop_order(tier) if replicas_first else self.lru(tier)
            victim = next(self.policy.drop_order(tier) if replicas_first else self.policy.lru(tier), None)
            assert victim == (order[0] if order else None)
            if victim is None:
                return
            self.change("remove", victim, tier, 1, False, "")

    @rule(tier=TIERS, n=st.integers(1, 8))
    def demote_in_a_batch(self, tier: Tier, n: int) -> None:
        """``moves.demotions``: walk the LRU order, pinning each key before the next (a move begun)."""
        want = self.lru(tier)[:n]
        got: list[bytes] = []
        for k in self.policy.lru(tier):
            if len(got) == n:
                break
            got.append(k)
            self.change("pin", k, tier, 1, False, "")
        assert got == want

    @rule(tier=TIERS, tenant=st.none() | TENANTS, data=st.data())
    def walk_while_changing(self, tier: Tier, tenant: str | None, data: st.DataObject) -> None:
        """Any change between two steps of a walk: each step is the least recent chunk past the last one, as of then."""
        walk, last = self.policy.lru(tier, tenant), None  # last: the model's entry of the chunk yielded last
        for _ in range(data.draw(st.integers(1, 6))):
            want = next((e for e in self.entries(tier, tenant) if last is None or e > last), None)
            got = next(walk, None)
            assert got == (None if want is None else want[2])
            if want is None:
                return
            last = want
            self.change(
                data.draw(self.CHANGES),
                self.some_key(data),
                data.draw(TIERS),
                data.draw(st.integers(1, 9)),
                data.draw(st.booleans()),
                data.draw(TENANTS),
            )

    @invariant()
    def books_agree(self) -> None:
        self.policy.check_invariants()
        for tier in (Tier.DRAM, Tier.NVME):
            assert self.policy.count(tier) == sum(m.tier is tier for m in self.model.values())
        used: dict[str, dict[Tier, int]] = {}
        for m in self.model.values():
            used.setdefault(m.tenant, {}).setdefault(m.tier, 0)
            used[m.tenant][m.tier] += m.size
        assert self.policy.used() == used


LruMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestLruMachine = LruMachine.TestCase
