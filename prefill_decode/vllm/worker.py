"""The worker side of :class:`~kvpool.prefill_decode.vllm.connector.KvPoolConnector`: moves KV bytes between
vLLM's paged cache and the pool on one I/O thread, as the scheduler side's :class:`KvPoolMetadata` says."""

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.errors import ConfigError, KvPoolError
from kvpool.metadata.identities import fingerprint
from kvpool.metadata.misses import MissCause
from kvpool.prefill_decode.connector_core.connection import START_WAIT_S, PoolConnection
from kvpool.prefill_decode.connector_core.counts import EngineCounts
from kvpool.prefill_decode.connector_core.staging import HostStaging
from kvpool.prefill_decode.connector_core.tenancy import TenantScope
from kvpool.prefill_decode.vllm.blocks import PagedLayer
from kvpool.prefill_decode.vllm.config import ConnectorConfig
from kvpool.prefill_decode.vllm.events import SavedChunks
from kvpool.prefill_decode.vllm.groups import NULL_BLOCK, KvGroups
from kvpool.prefill_decode.vllm.loads import BlockLoads
from kvpool.prefill_decode.vllm.scheduler import KvPoolMetadata, Transfer
from kvpool.prefill_decode.vllm.stats import KvPoolStats

log = logging.getLogger(__name__)


class WorkerSide:
    """Moves bytes between vLLM's paged KV and the pool on one I/O thread (a PoolClient is used by one thread)."""

    def __init__(
        self,
        config: ConnectorConfig,
        identity: CacheIdentity,
        groups: KvGroups,
        num_blocks: int,
        loads_kv: bool = True,
        writes: bool = True,
    ) -> None:
        self.config, self.identity, self.groups, self.num_blocks = config, identity, groups, num_blocks
        self.fingerprint = fingerprint(identity)  #: every put carries it to the placements (and chunk events)
        self.loads_kv = loads_kv
        self.writes = writes  #: False: another rank writes this rank's KV (MLA's, the same on every rank)
        self.tenants = TenantScope.load(config.tenants)
        self.bpc = groups.blocks_per_chunk
        self.layers: dict[str, PagedLayer] = {}
        self.connection = PoolConnection(config)  #: the pool client, made on the I/O thread when first needed
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvpool-connector-io")
        self._layer_ready: dict[str, threading.Event] = {}
        self._load: Future[None] | None = None
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._save_staging = HostStaging()  #: a reused host buffer (off the CPU: blocks are gathered into it)
        self.blocks = BlockLoads(groups, self.layers)  #: loads into the blocks (and vLLM's KV memory registered)
        #: layers to save, taken together by the next _put, with their blocks if already copied out
        self._queued: list[tuple[PagedLayer, Transfer, torch.Tensor | None]] = []
        self._whole_ended: set[str] = set()  #: whole-request loads done or failed since :meth:`loaded`
        self._whole_failed: set[str] = set()
        self._unsaved: dict[str, int] = {}  #: per request, queued layer saves not yet put
        self._saving = threading.Lock()
        self._finished: set[str] = set()  #: requests vLLM finished, whose saves may still run
        #: what this worker did, and the scheduler's lookups it hands on: reported to its pool node (kvpool_engine_*)
        #: from the I/O thread, the one that uses the client
        self.counts = EngineCounts(readers=("pool", "engine"))  #: the pool node's metrics and vLLM's own stats
        self.saved = SavedChunks(groups)  #: the chunks its puts saved, for vLLM's KV events

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's KV tensors, one per layer (layers of several groups may share memory: a block id is one group's);
        the pool's layers only (not a state layer's)."""
        for plan in self.groups.layers:
            kv = kv_caches[plan.name]
            dims = [d for d, n in enumerate(kv.shape) if n == self.num_blocks]
            if not dims:
                raise ConfigError(
                    f"KvPoolConnector: layer {plan.name}'s KV tensor {tuple(kv.shape)} has no dimension of "
                    f"{self.num_blocks} blocks; this attention backend's layout is not supported"
                )
            self.layers[plan.name] = PagedLayer(plan, kv, dims[0], self.groups.tail(plan), self.bpc)
        # connect now (Ray, etcd, the transport), not in the first request's step: the engine starts connected
        with contextlib.suppress(FutureTimeout):
            self._io.submit(self.connection.client).result(timeout=START_WAIT_S)

    @property
    def client(self) -> Any:
        """The PoolClient once the I/O thread made it (None before, and while the pool cannot be reached)."""
        return self.connection.connected

    # -- a step: loads before the forward, saves as layers finish ---------------------------------------------

    def start_step(self, meta: KvPoolMetadata) -> None:
        self._load = None
        self.counts.add(**meta.counts)
        whole = [t for t in meta.loads if t.whole_request]
        if whole:  # vLLM schedules these requests once they are reported ended: no layer waits for them
            self._io.submit(self._load_whole, whole)
        loads = [t for t in meta.loads if not t.whole_request]
        if not loads or not self.layers:
            self._layer_ready = {}
            return
        self._layer_ready = {name: threading.Event() for name in self.layers}
        self._load = self._io.submit(self._load_all, loads)
        if any(t.whole_before_forward for t in loads):
            self._load.result()

    def wait_layer(self, layer_name: str) -> None:
        ready = self._layer_ready.get(layer_name)
        if ready is not None:
            ready.wait()

    def _load_all(self, loads: list[Transfer]) -> None:
        """Load ``loads`` layer by layer, each layer's event set once it is in; blocks of chunks that did not come
        are reported by :meth:`take_load_errors` (vLLM recomputes from there)."""
        try:
            # the forward waits for all of it: every layer in one batch
            whole = not self.config.layerwise or any(t.whole_before_forward for t in loads)
            failed = self._load_layers(loads, lambda layer: self._layer_ready[layer.name].set(), at_once=whole)
            errors = {b for t, bad in zip(loads, failed, strict=True) for b in self._blocks_of(t, bad)}
            with self._errors_lock:
                self._load_errors |= errors
            self.counts.add(load_errors=len(errors))
        finally:
            for ready in self._layer_ready.values():
                ready.set()  # never leave a layer waiting
            self._report()

    def _load_whole(self, loads: list[Transfer]) -> None:
        """Load ``loads`` of requests vLLM holds back until :meth:`loaded` reports them ended (failed: vLLM
        computes the request from its start)."""
        failed: list[set[int]] = [set(range(t.first, t.end)) for t in loads]
        try:
            failed = self._load_layers(loads, lambda layer: None, at_once=True)
            self.counts.add(load_errors=sum(len(self._blocks_of(t, bad)) for t, bad in zip(loads, failed, strict=True)))
        finally:
            with self._errors_lock:
                self._whole_ended |= {t.req_id for t in loads}
                self._whole_failed |= {t.req_id for t, bad in zip(loads, failed, strict=True) if bad}
            self._report()

    def _load_layers(self, loads: list[Transfer], layer_loaded: Any, at_once: bool = False) -> list[set[int]]:
        """Every layer of ``loads``, ``layer_loaded(layer)`` after each; per load, the chunks that did not come.
        ``at_once``: nothing waits for a layer before the others (the forward waits for the whole load, or vLLM for
        the request's): every layer's chunks in one batch (one round of node calls and transfers, not one a layer)."""
        started = time.perf_counter()
        loaded_bytes = 0
        client = self.connection.client()
        keys = [self._keys(t) if client else [] for t in loads]
        failed: list[set[int]] = [set() for _ in loads]  #: chunk indices that did not arrive, per request
        jobs = [
            [(layer, t, ks, bad) for t, ks, bad in zip(loads, keys, failed, strict=True)]
            for layer in self.layers.values()
        ]
        one_batch = client is not None and at_once
        if one_batch:
            loaded_bytes = self.blocks.load(client, [job for layer_jobs in jobs for job in layer_jobs])
        for layer, layer_jobs in zip(self.layers.values(), jobs, strict=True):
            if client is None:
                for t, bad in zip(loads, failed, strict=True):
                    bad.update(range(t.first, t.end))
            elif not one_batch:
                loaded_bytes += self.blocks.load(client, layer_jobs)
            layer_loaded(layer)
        self.counts.add(
            loaded_tokens=sum((t.end - t.first) * self.config.chunk_size for t in loads),
            loaded_bytes=loaded_bytes,
            load_seconds=time.perf_counter() - started,
        )
        if any(failed):  # the chunks were there when looked up, and could not be read: recomputed
            self.counts.miss(MissCause.READ_FAILED, sum(1 for bad in failed if bad))
        return failed

    def _blocks_of(self, t: Transfer, bad: set[int]) -> list[int]:
        bpc = self.bpc
        return [
            ids[b]
            for ids in t.block_ids
            for c in sorted(bad)
            for b in range(c * bpc, min((c + 1) * bpc, len(ids)))
            if b >= t.write_from and ids[b] != NULL_BLOCK
        ]

    def loaded(self) -> tuple[set[str], set[str]]:
        """Requests whose whole-request load ended since the last call, and those of them that failed."""
        with self._errors_lock:
            ended, failed = self._whole_ended, self._whole_failed
            self._whole_ended, self._whole_failed = set(), set()
        return ended, failed

    def layer_done(self, layer_name: str, meta: KvPoolMetadata) -> None:
        """A layer has been computed: queue its chunks of this step's saves (the forward pass goes on).  The
        step's end hands the queue to the I/O thread as one batch: two node calls and one etcd transaction for
        every layer, where a put per layer cost 30 of each for a 30-layer model and a producer's step waited for
        all of them.  A sliding-window layer's blocks are copied out now: vLLM may free those the window leaves
        before the request ends (and give them to another request in the next step)."""
        layer = self.layers.get(layer_name)
        if layer is None or not meta.saves:
            return
        with self._saving:
            for t in meta.saves:
                self._unsaved.setdefault(t.req_id, 0)  # reported saved when vLLM finishes it, if nothing is queued
                if self.writes:
                    data = layer.gather(self._save_ids(layer, t)) if layer.plan.window else None
                    self._queued.append((layer, t, data))
                    self._unsaved[t.req_id] += 1
                    self.saved.queued(t)

    def _save_ids(self, layer: PagedLayer, t: Transfer) -> list[int]:
        """The blocks ``layer`` stores of ``t``'s chunks, chunk after chunk."""
        ids = t.block_ids[layer.plan.group]
        return [ids[p] for c in range(t.first, t.end) for p in layer.positions(c)]

    def _put(self) -> None:
        with self._saving:
            batch, self._queued = self._queued, []
        if not batch:
            return  # an earlier _put took this layer's saves with its own
        started, ok = time.perf_counter(), False
        try:
            client = self.connection.client()
            if client is None:
                self.counts.add(save_errors=len(batch))
                return
            staged = [(layer, t) for layer, t, d in batch if d is None and not layer.direct]
            buf = self._save_staging.get(client, sum((t.end - t.first) * x.tail * x.block_bytes for x, t in staged))
            items: dict[str, list[tuple[bytes, Any]]] = {}  #: per tenant: its quota, its chain
            at = saved = 0
            for layer, t, copied in batch:
                ids, tail, keys = self._save_ids(layer, t), layer.tail, self._keys(t)
                saved += len(ids) * layer.block_bytes
                if copied is None and layer.direct:  # the blocks themselves, gathered as they are written
                    chunks: list[Any] = layer.pieces([ids[i * tail : (i + 1) * tail] for i in range(len(keys))])
                else:
                    data = layer.blocks(ids, buf[at:]) if copied is None else copied
                    at += 0 if copied is not None else len(ids) * layer.block_bytes
                    chunks = [data[i * tail : (i + 1) * tail] for i in range(len(keys))]
                mine = items.setdefault(t.tenant, [])
                mine += [(layer_key(k, layer.index), c) for k, c in zip(keys, chunks, strict=True)]
            try:
                for tenant, chunk_layers in items.items():
                    client.put_batch(
                        chunk_layers, replicas=self.config.replicas, tenant=tenant, identity=self.fingerprint
                    )
            except KvPoolError as exc:  # a full pool, etcd or a node gone: a future miss, never an engine error
                log.warning("kvpool: could not save %d chunk layers: %s", sum(map(len, items.values())), exc)
                self.counts.add(save_errors=len(batch))
                return
            self.counts.add(
                # a transfer's tokens once, not once per layer of it
                saved_tokens=sum(
                    (t.end - t.first) * self.config.chunk_size for t in {id(t): t for _, t, _ in batch}.values()
                ),
                saved_bytes=saved,
                save_seconds=time.perf_counter() - started,
            )
            ok = True
        finally:
            self.saved.put([t for _, t, _ in batch], ok)  # before the request can be reported saved
            with self._saving:
                for _, t, _ in batch:
                    self._unsaved[t.req_id] -= 1
            self._report()

    def _keys(self, t: Transfer) -> list[bytes]:
        """The chunk keys of a transfer's chunks, in its tenant's chain."""
        return chunk_keys(self.identity, t.tokens, self.tenants.scope(t.tenant))[t.first : t.end]

    def end_step(self, meta: KvPoolMetadata) -> None:
        """A producer's step ends when its saves are in the pool (a decode engine asked next finds them); the
        others' saves go on in the background.  Loads of the step are over by now (every layer waited)."""
        if self._load is not None:
            self._load.result()
        with self._saving:
            queued = bool(self._queued)
        if queued:
            saving = self._io.submit(self._put)
            if not self.loads_kv:
                saving.result()

    def drain(self, req_ids: set[str]) -> None:
        """Preempted requests' blocks are about to be reused: whatever is queued must have read them first."""
        with self._saving:
            pending = any(self._unsaved.get(r) for r in req_ids)
        if pending:
            self._io.submit(self._put).result()  # after every earlier task of the one I/O thread

    def finished(self, finished_req_ids: set[str]) -> set[str] | None:
        with self._saving:
            self._finished |= finished_req_ids & self._unsaved.keys()
            done = {r for r in self._finished if self._unsaved[r] == 0}
            for r in done:
                self._finished.discard(r)
                del self._unsaved[r]
        return done or None

    def take_stats(self) -> KvPoolStats | None:
        """What this worker counted since vLLM last asked (None: nothing), for vLLM's ``/metrics`` and log line."""
        counts = self.counts.take("engine")
        return KvPoolStats(data=counts) if counts else None

    def take_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _report(self) -> None:
        """Hand the counts to the pool client, and take its transfer faults into the engine's own (on the I/O thread,
        the one that uses it)."""
        if self.client is not None:
            self.counts.transfer_faults(self.client.transfer_faults)
            self.counts.report(self.client)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._io.submit(self._close_client).result(timeout=30)
        self._io.shutdown(wait=False)

    def _close_client(self) -> None:
        if self.client is not None:
            self._report()
            self.blocks.close(self.client)
            self._save_staging.close(self.client)
        self.connection.close()
