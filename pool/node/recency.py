"""Keys in recency order, by group: binary heaps with lazy updates (no I/O).

A key's recency is ``(last access time, access sequence)``, read off its item (the eviction policy's record of a
chunk) whenever it is needed; ties on the clock break by access order, and the key breaks none (sequences are unique).
A list kept in access order cannot follow how that order changes: a chunk moved to another tier keeps its recency and
lands among that tier's chunks, an unpinned chunk comes back at the recency it had, and the wall clock can step back.
So each group is a binary heap of entries ``(last access, sequence, key)``, least recent on top, changed lazily:

- a touch only moves an item's recency later: its entries stay where they are, a bound from below, and an entry
  found out of date (at the top, or by a walk) is pushed again at its place (once, however many touches came
  before), so a touch costs O(1);
- any other change (the key put in other groups, taken out, its recency earlier) leaves its old entries stale: each
  heap knows the entry that counts for each of its keys, walks skip the others, the top is popped while it is stale,
  and a heap whose stale entries outnumber its live ones is rebuilt from them.

Finding the least recent key of a group is O(log n) amortised; so is each further step of a walk.
"""

import heapq
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

Entry = tuple[float, int, bytes]  #: (last access time, access sequence, key): least recent first
Groups = tuple[Hashable, ...]

SLACK = 64  #: the default of ``RecencyIndex.slack``


class Timed(Protocol):
    """What the index reads a key's recency from."""

    last_access: float
    seq: int


@dataclass(eq=False)  # one per group: compared by identity
class _Heap:
    group: Hashable
    entries: list[Entry] = field(default_factory=list)  #: a binary heap, stale entries included
    current: dict[bytes, Entry] = field(default_factory=dict)  #: the entry that counts, per key in the group
    changes: int = 0  #: bumped whenever ``entries`` is reordered or replaced (a walk then finds its place again)
    late: list[bytes] = field(default_factory=list)  #: keys a walk found out of date: pushed at their recency next


class RecencyIndex:
    """Keys, each in the groups it was put in; walks yield the keys of some groups least recent first.

    An item's recency may grow without the index being told (a touch); it must not shrink without a new :meth:`put`.
    """

    def __init__(self, slack: int = SLACK) -> None:
        self.slack = slack  #: stale entries a heap may carry beyond as many as it has live ones before it is rebuilt
        self._items: dict[bytes, tuple[Timed, tuple[_Heap, ...]]] = {}  #: each key's item, and its groups' heaps
        self._heaps: dict[Hashable, _Heap] = {}
        self._touches = 0  #: touches so far (a walk in progress looks again after one)

    def __len__(self) -> int:
        return len(self._items)

    def lookup(self, key: bytes) -> tuple[Timed, Groups] | None:
        """``key``'s item and groups (None: not indexed)."""
        found = self._items.get(key)
        return None if found is None else (found[0], tuple(heap.group for heap in found[1]))

    def put(self, key: bytes, item: Timed, groups: Groups) -> None:
        """Index ``key`` at ``item``'s recency in each of ``groups``, and out of those it was in."""
        self.discard(key)
        entry = (item.last_access, item.seq, key)
        heaps = tuple(self._heap(group) for group in groups)
        self._items[key] = (item, heaps)
        for heap in heaps:
            self._push(heap, entry)

    def touch(self, key: bytes) -> None:
        """``key``'s item is later now than it was: nothing moves (its entries stay, a bound from below), but a walk
        in progress starts a pass again after its next step, to find the key at its place."""
        self._touches += 1

    def discard(self, key: bytes) -> None:
        """Take ``key`` out (its entries go stale); a key not indexed is left alone."""
        found = self._items.pop(key, None)
        for heap in found[1] if found is not None else ():
            del heap.current[key]

    def walk(self, *groups: Hashable) -> Iterator[bytes]:
        """The keys of ``groups``, least recent first.  Each step yields the least recent key past the last one
        yielded among the keys indexed at that step, at their recency then: a key taken out meanwhile is skipped,
        one put or touched meanwhile past the last one yielded is yielded (again, if it was yielded already)."""
        heaps = [self._heap(g) for g in groups]
        last: Entry | None = None
        while True:  # a pass over the heaps as they are; another from the top if one of them changes under it
            for heap in heaps:
                self._catch_up(heap)
                self._settle_top(heap)
            seen = (self._touches, [heap.changes for heap in heaps])
            for entry in self._ordered(heaps, last):
                last = entry
                yield entry[2]
                if (self._touches, [heap.changes for heap in heaps]) != seen:
                    break
            else:
                return

    def _ordered(self, heaps: list[_Heap], after: Entry | None) -> Iterator[Entry]:
        """The live keys of ``heaps`` past ``after``, as entries at their recency, in order, read off the heaps without
        changing them: a frontier of heap positions, least entry first, where popping one pushes its children, and an
        entry out of date comes back at its recency (position -1: no children).  The entries up to ``after`` are
        passed through, not yielded: they form the top of each heap, so passing them costs as many steps as them."""
        front = [(heap.entries[0], n, 0) for n, heap in enumerate(heaps) if heap.entries]
        heapq.heapify(front)
        while front:
            entry, n, i = heapq.heappop(front)
            heap = heaps[n]
            key = entry[2]
            if i >= 0:
                for child in (2 * i + 1, 2 * i + 2):
                    if child < len(heap.entries):
                        heapq.heappush(front, (heap.entries[child], n, child))
                if heap.current.get(key) is not entry:
                    continue  # stale
            elif key not in heap.current:
                continue  # taken out since it came back at its recency
            now = self._recency(key)
            if now != entry:
                heapq.heappush(front, (now, n, -1))  # touched since this entry was pushed: it belongs later
                if i >= 0:
                    heap.late.append(key)
            elif after is None or entry > after:
                yield entry

    def _recency(self, key: bytes) -> Entry:
        item = self._items[key][0]
        return (item.last_access, item.seq, key)

    def _heap(self, group: Hashable) -> _Heap:
        heap = self._heaps.get(group)
        if heap is None:
            heap = self._heaps[group] = _Heap(group)
        return heap

    def _push(self, heap: _Heap, entry: Entry) -> None:
        current = heap.current
        if len(heap.entries) > 2 * len(current) + self.slack:  # mostly stale: rebuild from the live ones (O(n) per n)
            heap.entries = [e for e in heap.entries if current.get(e[2]) is e]
            heapq.heapify(heap.entries)
        heapq.heappush(heap.entries, entry)
        current[entry[2]] = entry
        heap.changes += 1

    def _catch_up(self, heap: _Heap) -> None:
        """Push the keys a walk found out of date at their recency (their old entries go stale), so that the walks
        after it find them in place."""
        for key in heap.late:
            entry = heap.current.get(key)
            if entry is not None and entry != (now := self._recency(key)):
                self._push(heap, now)
        heap.late.clear()

    def _settle_top(self, heap: _Heap) -> None:
        """Pop stale entries off the top, and move an entry out of date to its place, until the top is neither."""
        entries, current = heap.entries, heap.current
        while entries:
            top = entries[0]
            if current.get(top[2]) is not top:
                heapq.heappop(entries)
            else:
                now = self._recency(top[2])
                if now == top:
                    return
                heapq.heapreplace(entries, now)
                current[top[2]] = now
            heap.changes += 1

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the heaps disagree with the keys' items and groups (for tests and audits;
        O(n))."""
        for group, heap in self._heaps.items():
            entries = heap.entries
            for i in range(1, len(entries)):
                _require(entries[(i - 1) // 2] <= entries[i], f"group {group!r}: not a heap at position {i}")
            live = [id(e) for e in entries if heap.current.get(e[2]) is e]
            _require(len(set(live)) == len(live) == len(heap.current), f"group {group!r}: live entries not once each")
            for key, entry in heap.current.items():
                found = self._items.get(key)
                _require(found is not None and heap in found[1], f"group {group!r}: holds a key not in it")
                _require(entry <= self._recency(key), f"key {key.hex()[:16]}: its entry is later than its recency")
        for key, (_, heaps) in self._items.items():
            for heap in heaps:
                _require(self._heaps.get(heap.group) is heap, f"group {heap.group!r}: two heaps")
                _require(key in heap.current, f"key {key.hex()[:16]}: not in group {heap.group!r}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
