"""Eviction candidates: the policy's recency heaps beside a full sort of the tier for every question (the reference).

No pool, no segments: ``EvictionPolicy`` alone, on one tier of ``--sizes`` chunks (the DRAM tier; 10% of them with a
copy elsewhere, three tenants, 1% pinned by readers), after as many random touches on a clock that advances.  The
reference is the policy as it was before its order was indexed: each question lists the tier's unpinned chunks and
sorts them, over copies of the policy's chunk records.  Each way is timed on its own, then their answers are compared
(interleaved, a sort of the tier evicts from the CPU caches what the policy would find there).  Rows:

- victim (lru): the store's next victim in DRAM with NVMe below, ``next(policy.lru(tier))``, the tier unchanged;
- victim (drop order): the same in the last tier, those with a copy elsewhere first;
- evict in a row: the store's ``_allocate`` loop: pick the drop order's first, remove it, pick again
  (``--victims`` times; the time per victim, its removal included);
- demotion batch: ``moves.demotions``: walk the LRU order, pinning each of ``--batch`` chunks (per batch);
- over quota: a tenant ``--batch`` chunks over its quota, ``policy.over_quota`` (per call);
- touch, and read: what a read pays, a touch alone (``touch``) or a pin, touch and release (``locate`` and
  ``release``); the reference sets the record's fields and nothing else.

Times are the median of ``--repeat`` rounds, in microseconds per operation.

    python bench/eviction.py [--sizes 1000,10000,100000] [--victims 50] [--batch 32] [--repeat 5]
"""

import argparse
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.pool.node.eviction import Entry, EvictionPolicy

console = Console(width=170)
TIER = Tier.DRAM
TENANTS = ("", "acme", "globex")


class FullSort:
    """The reference: the policy's questions answered by sorting the tier every time, over the policy's records."""

    def __init__(self, states: dict[bytes, Entry]) -> None:
        self.states = states

    def lru(self, tier: Tier, tenant: str | None = None) -> Iterator[bytes]:
        items = [
            (st.last_access, st.seq, k)
            for k, st in self.states.items()
            if st.tier is tier and not st.pins and (tenant is None or st.tenant == tenant)
        ]
        return (k for _, _, k in sorted(items))

    def drop_order(self, tier: Tier) -> Iterator[bytes]:
        order = list(self.lru(tier))
        yield from (k for k in order if self.states[k].replicated)
        yield from (k for k in order if not self.states[k].replicated)

    def over_quota(self, tenant: str, excess: int) -> list[bytes]:
        out: list[bytes] = []
        for key in self.lru(TIER, tenant):
            if excess <= 0:
                break
            out.append(key)
            excess -= self.states[key].size
        return out


def build(n: int, rng: random.Random) -> tuple[EvictionPolicy, FullSort]:
    """The policy, and the reference over copies of its chunk records (kept equal by the benchmark)."""
    clock = ManualClock()
    policy = EvictionPolicy(clock)
    keys = [i.to_bytes(32, "big") for i in range(n)]
    for k in keys:
        policy.add(k, TIER, 1, replicated=rng.random() < 0.1, tenant=rng.choice(TENANTS))
        clock.advance(0.001)
    for k in rng.choices(keys, k=n):
        policy.touch(k)
        clock.advance(0.001)
    for k in rng.sample(keys, n // 100):
        policy.pin(k)
    return policy, FullSort({k: replace(policy.state(k)) for k in keys})


def median_us(fn: Callable[[], object], calls: int, repeat: int) -> float:
    """Microseconds per call of ``fn``: the median of ``repeat`` rounds of ``calls`` calls."""
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds) * 1e6


def steady_rows(policy: EvictionPolicy, ref: FullSort, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Questions that change nothing: (policy µs, reference µs) each, answers checked first."""
    n, excess = len(ref.states), args.batch
    quota = {"acme": (policy.used()["acme"][TIER] - excess, 0)}  # acme's chunks all take 1 byte
    assert next(policy.lru(TIER)) == next(ref.lru(TIER))
    assert next(policy.drop_order(TIER)) == next(ref.drop_order(TIER))
    assert policy.over_quota(quota, TIER) == ref.over_quota("acme", excess)
    fast, slow = 2000, max(2, 20_000 // n)
    return {
        "victim (lru)": (
            median_us(lambda: next(policy.lru(TIER)), fast, args.repeat),
            median_us(lambda: next(ref.lru(TIER)), slow, args.repeat),
        ),
        "victim (drop order)": (
            median_us(lambda: next(policy.drop_order(TIER)), fast, args.repeat),
            median_us(lambda: next(ref.drop_order(TIER)), slow, args.repeat),
        ),
        "over quota": (
            median_us(lambda: policy.over_quota(quota, TIER), fast // 10, args.repeat),
            median_us(lambda: ref.over_quota("acme", excess), slow, args.repeat),
        ),
    }


def demotion_batches(policy: EvictionPolicy, ref: FullSort, batch: int, repeat: int) -> tuple[float, float]:
    """``repeat`` batches each way: the policy walks its order pinning each chunk (let go after, untimed); the
    reference takes the first of a sorted copy, as the store did (a pin is one field: not taken).  (policy µs,
    reference µs) per batch, the medians; the same chunks each way."""
    new: list[float] = []
    old: list[float] = []
    got: list[bytes] = []
    want: list[bytes] = []
    for _ in range(repeat):
        start = time.perf_counter()
        got = []
        for k in policy.lru(TIER):
            if len(got) == batch:
                break
            policy.pin(k)
            got.append(k)
        new.append(time.perf_counter() - start)
        for k in got:
            policy.unpin(k)
    for _ in range(repeat):
        start = time.perf_counter()
        want = list(ref.lru(TIER))[:batch]
        old.append(time.perf_counter() - start)
    assert got == want, "the policy and the full sort demote different chunks"
    return statistics.median(new) * 1e6, statistics.median(old) * 1e6


def evict_in_a_row(policy: EvictionPolicy, ref: FullSort, victims: int) -> tuple[float, float]:
    """Pick, remove, pick again, ``victims`` times each way: (policy µs, reference µs) per victim (the medians); the
    same victims each way."""
    new: list[float] = []
    old: list[float] = []
    got: list[bytes] = []
    want: list[bytes] = []
    for _ in range(victims):
        start = time.perf_counter()
        v = next(policy.drop_order(TIER))
        policy.remove(v)
        new.append(time.perf_counter() - start)
        got.append(v)
    for _ in range(victims):
        start = time.perf_counter()
        v = next(ref.drop_order(TIER))
        del ref.states[v]
        old.append(time.perf_counter() - start)
        want.append(v)
    assert got == want, "the policy and the full sort picked different victims"
    return statistics.median(new) * 1e6, statistics.median(old) * 1e6


def reads(policy: EvictionPolicy, ref: FullSort, rng: random.Random, repeat: int) -> dict[str, tuple[float, float]]:
    """What reads pay: a touch (``touch``), and a pin, touch and release (``locate``, then ``release``), of a
    random chunk: (policy µs, reference µs) per read; the reference sets the record's fields and nothing else."""
    calls = 1000
    keys = rng.sample(list(ref.states), min(1000, len(ref.states)))
    seq = itertools.count(10**12)

    def old_touch(k: bytes) -> None:
        st = ref.states[k]
        st.last_access, st.seq = policy.clock.time(), next(seq)

    def old_read(k: bytes) -> None:
        ref.states[k].pins += 1
        old_touch(k)
        ref.states[k].pins -= 1

    def new_read(k: bytes) -> None:
        policy.pin(k)
        policy.touch(k)
        policy.unpin(k)

    out = {}
    for name, new, old in (("touch", policy.touch, old_touch), ("read: pin, touch, release", new_read, old_read)):
        new_keys, old_keys = iter(rng.choices(keys, k=calls * repeat)), iter(rng.choices(keys, k=calls * repeat))
        out[name] = (
            median_us(lambda: new(next(new_keys)), calls, repeat),  # noqa: B023 (each lambda runs in its own turn)
            median_us(lambda: old(next(old_keys)), calls, repeat),  # noqa: B023
        )
    return out


def bench_size(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(n)
    policy, ref = build(n, rng)
    rows = steady_rows(policy, ref, args)
    rows["demotion batch"] = demotion_batches(policy, ref, args.batch, args.repeat)
    rows["evict in a row"] = evict_in_a_row(policy, ref, args.victims)
    rows.update(reads(policy, ref, rng, args.repeat))
    policy.check_invariants()
    return [{"chunks": n, "op": op, "policy_us": new, "full_sort_us": old} for op, (new, old) in rows.items()]


def render(rows: list[dict[str, Any]]) -> None:
    table = Table(title="eviction candidates: recency heaps vs a full sort of the tier (µs per operation, median)")
    for col in ("chunks in tier", "operation", "heaps µs", "full sort µs", "full sort / heaps"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for i, r in enumerate(rows):
        table.add_row(
            f"{r['chunks']:,}",
            r["op"],
            f"{r['policy_us']:.2f}",
            f"{r['full_sort_us']:.2f}",
            f"{r['full_sort_us'] / r['policy_us']:.1f}x",
            end_section=i + 1 < len(rows) and rows[i + 1]["chunks"] != r["chunks"],
        )
    console.print(table)
    console.print(
        "full sort: the tier's unpinned chunks listed and sorted for every question (the policy before its order was "
        "indexed), over copies of the same chunk records; the heaps' answers were checked against it.  touch, read: "
        "the reference sets fields; a touch leaves the heaps as they are, a pin takes the chunk out of them and its "
        "release pushes it back (what a read pays for O(log n) victims)."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000", help="comma-separated: chunks in the tier")
    ap.add_argument("--victims", type=int, default=50, help="victims picked and removed in a row, per size")
    ap.add_argument("--batch", type=int, default=32, help="chunks in a demotion batch, and a tenant's excess")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds per figure; the median is reported")
    ap.add_argument("--json", default="bench/results/eviction.json", help="where to write the figures")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for n in (int(s) for s in args.sizes.split(",") if s):
        with console.status(f"{n:,} chunks"):
            rows += bench_size(n, args)
    render(rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
