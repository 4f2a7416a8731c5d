"""``DeviceTier``: the top of the hierarchy — a worker's KV caches in device memory (HBM), under a budget.

A worker keeps the caches of its recent sequences on the device so that the next turn of a conversation
continues without any transfer.  Two watermarks keep the device from filling up:

- above ``offload_at`` (85 % of the budget) the least recently used caches are **offloaded**: their full
  chunks are copied into page-locked host buffers with non-blocking copies (the copy engine works while
  the model computes), and once a copy has landed — checked without blocking by :meth:`poll`, at the next
  admission, or waited for by :meth:`drain` — the chunks are put into the pool's DRAM tier and the device
  memory is freed;
- above ``drop_at`` (95 %) low-priority **scratch** caches (speculative branches, aborted requests) are
  dropped at once, without a copy: they are cheap to lose.

The same code runs on the CPU: the "device" is then host memory, copies complete immediately and no
memory is pinned.
"""

import enum
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvpool.core.config import Fraction, Positive, checked
from kvpool.errors import ConfigError
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.reference.connector import PoolConnector
from kvpool.prefill_decode.reference.layout import KVBuffer

log = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    SCRATCH = 0  #: dropped first, never offloaded
    NORMAL = 1  #: offloaded to the pool when the device runs short


@dataclass
class Resident:
    tokens: list[int]
    cache: DynamicCache
    nbytes: int
    priority: Priority
    scope: Scope | None = None  #: the tenant's chain its chunks are keyed in when offloaded


@dataclass
class _Offload:
    name: str
    entry: Resident
    buffer: KVBuffer
    keys: list[list[bytes]]
    event: Any  #: a torch.cuda.Event recorded after the copies; None on the CPU


def cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        held: Any = layer
        for t in (held.keys, held.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


class DeviceTier:
    @checked
    def __init__(
        self,
        connector: PoolConnector,
        budget_bytes: Positive,
        *,
        device: str | torch.device = "cpu",
        offload_at: Fraction = 0.85,
        drop_at: Fraction = 0.95,
    ) -> None:
        """``offload_at`` and ``drop_at``: the shares of ``budget_bytes`` held at which it offloads, and drops."""
        if offload_at >= drop_at:
            raise ConfigError(f"offload_at must be below drop_at ({drop_at}), got {offload_at}")
        self.connector = connector
        self.budget = budget_bytes
        self.device = torch.device(device)
        self.offload_at, self.drop_at = offload_at, drop_at
        self._resident: OrderedDict[str, Resident] = OrderedDict()  #: least recently used first
        self._pending: list[_Offload] = []  #: copies in flight, oldest first
        self.counts = {"admitted": 0, "offloaded": 0, "offloaded_bytes": 0, "dropped": 0, "hits": 0}

    @property
    def used(self) -> int:
        """Device bytes held, copies in flight included (their memory is not free yet)."""
        return sum(e.nbytes for e in self._resident.values()) + sum(p.entry.nbytes for p in self._pending)

    def admit(
        self,
        name: str,
        tokens: Sequence[int],
        cache: DynamicCache,
        priority: Priority = Priority.NORMAL,
        scope: Scope | None = None,
    ) -> None:
        """Keep ``cache`` (the KV of ``tokens``, a request of ``scope``'s tenant) on the device under ``name``, then
        apply the watermarks."""
        self.poll()
        if name in self._resident:
            del self._resident[name]
        self._resident[name] = Resident(list(tokens), cache, cache_bytes(cache), priority, scope)
        self.counts["admitted"] += 1
        self._enforce()
        self.poll()  # copies that are done already (all of them, on the CPU)

    def get(self, name: str) -> DynamicCache | None:
        """The resident cache called ``name`` (now the most recently used), or None if it left the device."""
        entry = self._resident.get(name)
        if entry is None:
            return None
        self._resident.move_to_end(name)
        self.counts["hits"] += 1
        return entry.cache

    def release(self, name: str) -> None:
        self._resident.pop(name, None)

    def _enforce(self) -> None:
        if self.used > self.drop_at * self.budget:
            for name in [n for n, e in self._resident.items() if e.priority is Priority.SCRATCH]:
                if self.used <= self.drop_at * self.budget:
                    break
                del self._resident[name]
                self.counts["dropped"] += 1
                log.info("device tier above %.0f%%: dropped scratch cache %s", 100 * self.drop_at, name)
        while sum(e.nbytes for e in self._resident.values()) > self.offload_at * self.budget:  # in flight: leaving
            victim = next((n for n, e in self._resident.items() if e.priority is Priority.NORMAL), None)
            if victim is None:
                break
            self._start_offload(victim, self._resident.pop(victim))

    def _start_offload(self, name: str, entry: Resident) -> None:
        keys = self.connector.keys(entry.tokens, entry.scope)
        if not keys:  # shorter than a chunk: nothing the pool keeps
            self.counts["dropped"] += 1
            return
        cuda = self.device.type == "cuda"
        buffer = KVBuffer(self.connector.layout, len(keys), pin=cuda)
        buffer.fill_from(entry.cache, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Offload(name, entry, buffer, keys, event))

    def poll(self) -> int:
        """Finish the offloads whose copies have landed (no waiting): put them into the pool, free their
        device memory.  Returns how many finished."""
        done = 0
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            self._finish(self._pending.pop(0))
            done += 1
        return done

    def drain(self) -> None:
        """Wait for every offload in flight and finish it."""
        while self._pending:
            p = self._pending.pop(0)
            if p.event is not None:
                p.event.synchronize()
            self._finish(p)

    def _finish(self, p: _Offload) -> None:
        self.connector.put_buffer(p.buffer, p.keys, tenant=p.entry.scope.tenant if p.entry.scope else "")
        self.counts["offloaded"] += 1
        self.counts["offloaded_bytes"] += p.buffer.tensor.numel() * p.buffer.tensor.element_size()
        log.info("device tier above %.0f%%: offloaded %s to the pool", 100 * self.offload_at, p.name)

    def stats(self) -> dict[str, Any]:
        return {"budget": self.budget, "used": self.used, "resident": len(self._resident), **self.counts}
