"""``PoolConnector``: a model's KV cache in and out of the pool.

``save`` cuts the full chunks of a cache into pool objects (see :mod:`.layout`) and puts them.  ``load``
fetches the first ``n`` chunks of a prefix into one reusable host buffer and hands back a ``DynamicCache``
that views it.  With a per-layer or groups-of-G layout the fetch runs on a thread, group by group, and a forward
pre-hook on each decoder layer waits only for *its* layer: layer ``l+1`` arrives while layer ``l``
computes.  A chunk that cannot be fetched (its node died, it was evicted, it is corrupt) surfaces as
:class:`~kvpool.errors.ChunkNotFound` from the model's forward; the caller recomputes.

One request at a time per connector: the next ``load`` reuses the buffer the previous cache viewed
(transformers has copied it by then — appending the first new token to a layer concatenates).
"""

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvpool.core.keys import CacheIdentity
from kvpool.core.types import nearest
from kvpool.errors import ChunkNotFound, ConfigError, KvPoolError
from kvpool.metadata.identities import fingerprint
from kvpool.metadata.lookup import Hit, PrefixLookup
from kvpool.metadata.misses import MissCause
from kvpool.pool.client import PoolClient
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.connector_core.counts import EngineCounts
from kvpool.prefill_decode.connector_core.staging import HostStaging
from kvpool.prefill_decode.reference.layout import KVBuffer, KVLayout

log = logging.getLogger(__name__)


@dataclass
class LoadTimes:
    fetch_s: list[float] = field(default_factory=list)  #: per round (a layer, or all): since the previous one landed
    stall_s: float = 0.0  #: time the model waited for a layer that had not arrived
    total_s: float = 0.0  #: first fetch started → last fetch done
    pipelined: bool = False  #: fetched on a thread while the model ran

    @property
    def overlap(self) -> float:
        """The share of fetch time hidden behind compute (0: none — always, when not pipelined; 1: all)."""
        fetch = sum(self.fetch_s)
        return max(0.0, 1.0 - self.stall_s / fetch) if fetch > 0 and self.pipelined else 0.0


class Loading:
    """A prefix being fetched into a :class:`KVBuffer`; ``cache`` views it from the start."""

    def __init__(
        self,
        buffer: KVBuffer,
        rounds: list[tuple[list[bytes], list[torch.Tensor]]],
        tokens: int | None = None,
        counts: EngineCounts | None = None,
    ) -> None:
        self.buffer = buffer
        self._counts = counts  #: told what a fetch that completes loaded
        self.cache: DynamicCache = buffer.to_cache(tokens)
        self.times = LoadTimes()
        self._rounds = rounds
        self._ready = [threading.Event() for _ in rounds]
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _fetch(self, client: PoolClient) -> None:
        """One batched get of every object (one pin call per holder), layer 0's first; each round's event
        is set the moment its last object lands."""
        start = time.perf_counter()
        keys = [k for ks, _ in self._rounds for k in ks]
        views = [v for _, vs in self._rounds for v in vs]
        round_of = [r for r, (ks, _) in enumerate(self._rounds) for _ in ks]
        missing = [len(ks) for ks, _ in self._rounds]
        seen: set[int] = set()  # an object retried on another replica may be reported twice
        last = start

        def landed(i: int) -> None:
            nonlocal last
            if i in seen:
                return
            seen.add(i)
            r = round_of[i]
            missing[r] -= 1
            if missing[r] == 0:
                now = time.perf_counter()
                self.times.fetch_s.append(now - last)
                last = now
                self._ready[r].set()

        try:
            client.get_into_batch(keys, views, on_done=landed)
            if self._counts is not None:
                layout = self.buffer.layout
                self._counts.add(
                    loaded_tokens=self.buffer.chunks * layout.chunk_size,
                    loaded_bytes=self.buffer.chunks * layout.chunk_size * layout.token_bytes,
                    load_seconds=time.perf_counter() - start,
                )
        except BaseException as exc:
            self._error = exc
            for event in self._ready:
                event.set()
        finally:
            self.times.total_s = time.perf_counter() - start

    def start(self, client: PoolClient, background: bool) -> "Loading":
        self.times.pipelined = background
        if background:
            self._thread = threading.Thread(target=self._fetch, args=(client,), name="kvpool-kv-fetch", daemon=True)
            self._thread.start()
        else:
            self._fetch(client)
        return self

    def wait(self, round_index: int) -> None:
        """Block until fetch round ``round_index`` is in the buffer; re-raise what stopped the fetch."""
        event = self._ready[min(round_index, len(self._ready) - 1)]
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.times.stall_s += time.perf_counter() - t0
        if self._error is not None:
            if isinstance(self._error, ChunkNotFound):
                raise ChunkNotFound(f"a chunk of the cached prefix could not be fetched: {self._error}")
            raise self._error

    def finish(self) -> None:
        """Wait for every layer (and the fetch thread)."""
        self.wait(len(self._ready) - 1)
        if self._thread is not None:
            self._thread.join()

    @contextmanager
    def attached(self, model: Any) -> Iterator[None]:
        """While inside, each decoder layer of ``model`` waits for its own layer's KV before it runs."""
        layers = model.model.layers
        group = self.buffer.layout.group
        hooks = [
            layer.register_forward_pre_hook(lambda *_, i=i: self.wait(i // group)) for i, layer in enumerate(layers)
        ]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            if self._thread is not None:
                self._thread.join()


class PoolConnector:
    def __init__(self, client: PoolClient, layout: KVLayout, identity: CacheIdentity) -> None:
        self.client = client
        self.layout = layout
        self.identity = identity
        self.fingerprint = fingerprint(identity)  #: every put carries it to the placements (and chunk events)
        try:
            client.register_identity(identity)  # for kvpool status: what keys this connector's chunks
        except KvPoolError as exc:
            log.warning("cache identity not registered (%s); chunks are stored and read all the same", exc)
        self.lookup = PrefixLookup(client.access_log)  #: the process's access log is the client's
        self.staging = HostStaging()  #: the buffer every load lands in
        self.counts = EngineCounts()  #: reported to the client's node: kvpool_engine_*, kvpool_misses_total

    def keys(self, tokens: Any, scope: Scope | None = None) -> list[list[bytes]]:
        return self.layout.keys(self.identity, tokens, scope)

    def cached(self, keys: Sequence[Sequence[bytes]], prompt_tokens: int) -> Hit:
        """How many leading chunks (of a prompt of ``prompt_tokens``, named by ``keys``) have every one of their
        objects in the pool, from the watch cache (no etcd round trip); counted and logged."""
        hit = self.lookup(self.client.cache, keys)
        self.client.count_lookup(hit.asked, hit.held)  # the node's chunk hit rate (kvpool status)
        self.counts.lookup(hit, prompt_tokens, self.layout.chunk_size)
        self.counts.report(self.client)
        return hit

    def fell_back(self) -> None:
        """Count a reload that could not read a chunk it had found (the request was recomputed)."""
        self.counts.miss(MissCause.READ_FAILED)
        self.counts.report(self.client)

    def save(
        self,
        cache: DynamicCache,
        keys: Sequence[Sequence[bytes]],
        first_chunk: int = 0,
        replicas: int = 1,
        tenant: str = "",
    ) -> int:
        """Put chunks ``first_chunk ..`` of ``cache`` (the full chunks ``keys`` names) as ``tenant``'s; bytes put."""
        count = len(keys) - first_chunk
        if count <= 0:
            return 0
        buffer = KVBuffer(self.layout, count)
        buffer.fill_from(cache, first_chunk)
        return self.put_buffer(buffer, keys[first_chunk:], replicas, tenant)

    def put_buffer(self, buffer: KVBuffer, keys: Sequence[Sequence[bytes]], replicas: int = 1, tenant: str = "") -> int:
        """Put a filled buffer's chunks, named by ``keys`` (one entry per chunk of the buffer), under this connector's
        cache identity; bytes put."""
        items = [(keys[c][g], view) for c, g, view in buffer.object_views()]
        started = time.perf_counter()
        self.client.put_batch(items, replicas=replicas, tenant=tenant, identity=self.fingerprint)
        nbytes = buffer.chunks * self.layout.chunk_size * self.layout.token_bytes
        self.counts.add(
            saved_tokens=buffer.chunks * self.layout.chunk_size,
            saved_bytes=nbytes,
            save_seconds=time.perf_counter() - started,
        )
        self.counts.report(self.client)
        return nbytes

    def load(
        self, keys: Sequence[Sequence[bytes]], chunks: int, *, tokens: int | None = None, pipelined: bool = True
    ) -> Loading:
        """Start fetching the first ``chunks`` chunks, for a cache of their first ``tokens`` positions (default:
        all); ``pipelined`` (layouts of more than one object per chunk) fetches on a thread, group by group, for
        :meth:`Loading.attached` to wait on."""
        if not 0 < chunks <= len(keys):
            raise ConfigError(f"chunks must be in [1, {len(keys)}], got {chunks}")
        here = self.client.node_id
        from_peer = any(
            (p := nearest(self.client.cache.replicas(k), here)) is not None and p.node != here
            for ks in keys[:chunks]
            for k in ks
        )
        # registered with the transport (once) when chunks will come from another node, so they land in it
        # directly (same-node loads copy from shared memory)
        nbytes = chunks * self.layout.chunk_size * self.layout.token_bytes
        storage = self.staging.get(self.client, nbytes, register=from_peer).view(self.layout.dtype)
        buffer = KVBuffer(self.layout, chunks, storage=storage)
        by_round: dict[int, tuple[list[bytes], list[torch.Tensor]]] = {}
        for c, g, view in buffer.object_views():
            ks, vs = by_round.setdefault(g, ([], []))
            ks.append(keys[c][g])
            vs.append(view)
        rounds = [by_round[r] for r in sorted(by_round)]
        loading = Loading(buffer, rounds, tokens, self.counts)
        return loading.start(self.client, background=pipelined and self.layout.groups > 1)

    def close(self) -> None:
        self.staging.close(self.client)
        self.counts.report(self.client)
