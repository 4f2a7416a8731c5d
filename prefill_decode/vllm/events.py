"""kvpool's chunks in vLLM's own KV-event stream (``--kv-events-config``): a router subscribed to an engine's
events sees what the pool holds of that engine's prompts beside the engine's own blocks, on one subscription.

- ``BlockStored``, once a chunk this engine saved is in the pool, every layer of it on every rank that writes: the
  workers report a save when its put returned (``get_kv_connector_kv_cache_events``: :class:`SavedChunks`), vLLM
  hands their reports to the scheduler side (``update_connector_output``), which publishes a chunk once every
  writing rank reported it (``take_events``: :class:`PoolEvents`).  One event per chunk and full-attention
  KV-cache group: the chunk's blocks' own vLLM block hashes (those of the engine's own ``BlockStored`` of the same
  blocks, so a router matches them by hash or by ``(parent, tokens)`` alike), its parent block's hash, its tokens;
- ``BlockRemoved`` of the same hashes once the pool no longer holds the chunk (evicted, removed, its node gone),
  and a ``BlockRemoved`` + ``BlockStored`` pair when it moves between tiers, as the scheduler side's watch cache
  sees them: it looks at the chunks it published, at most every :data:`SCAN_S` seconds and :data:`SCAN_BATCH` at a
  time, by one object of each (the first layer's, rank 0's: a chunk's layers are put, read and evicted together).

``medium`` is the pool tier, in the words kvpool's cluster-wide stream uses (:data:`~kvpool.metadata.zmq_events.MEDIUM`:
``CPU`` for a node's DRAM, ``DISK`` for NVMe, ``STORAGE`` for the remote tier; ``CPU`` and ``STORAGE`` are vLLM's own
media, those its OffloadingConnector's CPU and object-store tiers publish); ``ownership`` is ``"kvpool"``, the
secondary tier that emitted them, as vLLM's tiered offloading names its own.  vLLM publishes what a connector hands
it at its engine's steps: an idle engine publishes the removals it saw at its next step.
"""

import itertools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from kvpool.core.keys import layer_key
from kvpool.core.types import Placement, Tier
from kvpool.metadata.zmq_events import MEDIUM
from kvpool.prefill_decode.vllm.groups import KvGroups

OWNERSHIP = "kvpool"  #: the ``ownership`` of the connector's events: the tier system that emitted them
SCAN_S = 1.0  #: the scheduler side looks for removed and moved chunks at most this often
SCAN_BATCH = 4096  #: and at this many chunks at a time, those it looked at longest ago
UNSEEN_S = 10.0  #: a published chunk the watch cache never showed (its watch slow) is taken as removed after this
KEPT = 100_000  #: chunks (and pending reports) remembered at most, oldest forgotten first


class Saved(Protocol):
    """What a save tells the workers (:class:`~kvpool.prefill_decode.vllm.scheduler.Transfer`)."""

    tokens: list[int]
    first: int
    end: int
    hashes: list[Any]


def medium(tier: Tier) -> str:
    return MEDIUM.get(tier, tier.value.upper())


def chunk_stored(hashes: Sequence[Any], tokens: Sequence[int], chunk: int, groups: KvGroups, group: int) -> BlockStored:
    """The ``BlockStored`` of chunk ``chunk`` of a prompt whose blocks' vLLM hashes are ``hashes``, put in DRAM."""
    bpc, size = groups.blocks_per_chunk, groups.block_size
    return BlockStored(
        block_hashes=list(hashes[chunk * bpc : (chunk + 1) * bpc]),
        parent_block_hash=hashes[chunk * bpc - 1] if chunk else None,
        token_ids=list(tokens[chunk * groups.chunk_size : (chunk + 1) * groups.chunk_size]),
        block_size=size,
        lora_id=None,
        medium=medium(Tier.DRAM),
        lora_name=None,
        group_idx=group,
        ownership=OWNERSHIP,
    )


class PoolKVEvents(KVConnectorKVEvents):
    """The chunks workers saw saved since vLLM last asked; vLLM adds the workers' up (an event once per worker)."""

    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self.events: list[KVCacheEvent] = events or []

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events += events

    def aggregate(self) -> "PoolKVEvents":
        return self

    def increment_workers(self, count: int = 1) -> None:
        """The scheduler side counts reports per event itself (:class:`PoolEvents`)."""

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return 1

    def clear_events(self) -> None:
        self.events = []


class SavedChunks:
    """Worker side: the ``BlockStored`` of a save's chunks once every layer of it was put (a failed put: none)."""

    def __init__(self, groups: KvGroups) -> None:
        self.groups = groups
        self.full = sorted({layer.group for layer in groups.layers if not layer.window})
        #: per save (by id), while layers of it are queued: ``[save, layer saves not put, every put succeeded]``
        self._left: dict[int, list[Any]] = {}
        self._done: list[KVCacheEvent] = []
        self._lock = threading.Lock()

    def queued(self, save: Saved) -> None:
        """A layer of ``save`` was queued (saves without hashes: events are off)."""
        if save.hashes:
            with self._lock:
                self._left.setdefault(id(save), [save, 0, True])[1] += 1

    def put(self, saves: Sequence[Saved], ok: bool) -> None:
        """One put of a layer of each of ``saves`` returned (``ok``: the pool took them)."""
        with self._lock:
            for save in saves:
                entry = self._left.get(id(save))
                if entry is None:
                    continue
                entry[1] -= 1
                entry[2] = entry[2] and ok
                if entry[1] == 0:
                    del self._left[id(save)]
                    if entry[2]:
                        self._done += [
                            chunk_stored(save.hashes, save.tokens, c, self.groups, g)
                            for c in range(save.first, save.end)
                            for g in self.full
                        ]

    def take(self) -> PoolKVEvents | None:
        with self._lock:
            done, self._done = self._done, []
        return PoolKVEvents(done) if done else None


@dataclass
class _Published:
    event: BlockStored
    since: float
    seen: bool = False  #: the watch cache has shown the chunk (until then its absence is the watch's delay)


class Watched(Protocol):
    """What the scheduler side reads of its watch cache (:class:`~kvpool.metadata.cache.MetadataCache`)."""

    def replicas(self, key: bytes) -> list[Placement]: ...


class PoolEvents:
    """Scheduler side: which chunks its saves are to put (:meth:`expect`), the workers' reports of them
    (:meth:`confirm`), and the events vLLM publishes (:meth:`take`)."""

    def __init__(
        self, groups: KvGroups, hash_block_size: int, writers: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.groups, self.hash_block_size, self.writers, self.clock = groups, hash_block_size, writers, clock
        #: the pool object watched for each chunk, by the chunk's last block hash
        self._expected: OrderedDict[Any, bytes] = OrderedDict()
        self._reports: Counter[BlockStored] = Counter()  #: workers that reported each save, until all did
        self._published: OrderedDict[tuple[bytes, int | None], _Published] = OrderedDict()
        self._out: list[KVCacheEvent] = []
        self._scanned_at = 0.0
        full = [layer.index for layer in groups.layers if not layer.window]
        self._watched_layer = full[0] if full else -1

    def hashes(self, request: Any) -> list[Any]:
        """vLLM's hashes of the full blocks of ``request``'s prompt, at the stored layers' block size, as its
        events give them."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

        size = self.groups.block_size
        view = resolve_block_hashes(request.block_hashes, self.hash_block_size, size)
        n = min(len(request.prompt_token_ids or []) // size, len(view))
        return [maybe_convert_block_hash(view[i]) for i in range(n)]

    def expect(self, hashes: Sequence[Any], keys: Sequence[bytes], first: int) -> None:
        """Chunks ``first, first + 1, ...`` (chain keys ``keys``, rank 0's) of a prompt of block hashes ``hashes``
        are being saved."""
        if self._watched_layer < 0:
            return
        bpc = self.groups.blocks_per_chunk
        for c, key in enumerate(keys, first):
            if (c + 1) * bpc <= len(hashes):
                self._expected[hashes[(c + 1) * bpc - 1]] = layer_key(key, self._watched_layer)
                self._expected.move_to_end(hashes[(c + 1) * bpc - 1])
        _trim(self._expected)

    def confirm(self, events: list[KVCacheEvent]) -> None:
        """The workers' reports of one step: a chunk every writing rank reported is published."""
        for event in events:
            if not isinstance(event, BlockStored):
                continue
            self._reports[event] += 1
            if self._reports[event] < self.writers:
                continue
            del self._reports[event]
            self._out.append(event)
            watched = self._expected.get(event.block_hashes[-1])
            if watched is not None:
                self._published[(watched, event.group_idx)] = _Published(event, self.clock())
                _trim(self._published)
        _trim(self._reports)

    def take(self, cache: Watched | None) -> list[KVCacheEvent]:
        """The events to publish now: the chunks confirmed since the last call, then those the pool no longer
        holds or holds in another tier."""
        now = self.clock()
        if cache is not None and now - self._scanned_at >= SCAN_S:
            self._scanned_at = now
            self._scan(cache, now)
        out, self._out = self._out, []
        return out

    def _scan(self, cache: Watched, now: float) -> None:
        """Look at the :data:`SCAN_BATCH` chunks looked at longest ago (a bounded cost per step)."""
        for where in list(itertools.islice(self._published, SCAN_BATCH)):
            published = self._published[where]
            event = published.event
            replicas = cache.replicas(where[0])
            if replicas:
                published.seen = True
                now_in = medium(min((p.tier for p in replicas), key=lambda t: t.rank))
                if now_in != event.medium:
                    published.event = msgspec.structs.replace(event, medium=now_in)
                    self._out += [_removed(event), published.event]
                self._published.move_to_end(where)
            elif published.seen or now - published.since > UNSEEN_S:
                del self._published[where]
                self._out.append(_removed(event))


def _removed(event: BlockStored) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_idx, ownership=event.ownership
    )


def _trim(kept: "OrderedDict[Any, Any] | Counter[Any]") -> None:
    while len(kept) > KEPT:
        del kept[next(iter(kept))]
