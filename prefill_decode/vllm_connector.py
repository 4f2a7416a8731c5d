"""``KvPoolConnector``: vLLM's KV connector (API v1) over the pool.

vLLM loads it by module path (``--kv-transfer-config '{"kv_connector": "KvPoolConnector",
"kv_connector_module_path": "kvpool.prefill_decode.vllm_connector", "kv_role": ..., "kv_connector_extra_config":
{...}}'``; ``kvpool vllm-config`` prints that line for a running pool) and makes two of it:

- the **scheduler side**, in the engine's scheduler: ``get_num_new_matched_tokens`` answers how many prompt
  tokens the pool can supply from a watch-synced copy of etcd (:class:`~kvpool.metadata.cache.MetadataCache`;
  no round trip, no Ray), and ``build_connector_meta`` tells the workers, per step, which chunks to load into
  which blocks and which freshly computed chunks to save;
- the **worker side**, in each model worker: a :class:`~kvpool.pool.client.PoolClient` moves bytes between
  vLLM's paged KV tensors and the pool on one I/O thread.  Loads run layer by layer (``wait_for_layer_load`` waits
  for its own layer only); saves are queued by ``save_kv_layer`` as each layer finishes and never block the
  forward pass.  A chunk that cannot be loaded (gone, corrupt, its node died) is reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes from there: never wrong KV, never a hung request.

The pool object of a chunk is one layer of it: the chunk's ``chunk_size / block_size`` blocks laid end to end,
each a block of vLLM's KV tensor for that layer exactly as the attention backend lays it out (on CPU
``[kv_heads, block_size, 2 * head_size]``), keyed by :func:`~kvpool.pool.keys.layer_key` of the chunk's
chain key.  The cache identity names the vLLM version, device, attention backend, KV spec, block size,
tensor-parallel rank and the model, so engines whose KV cannot be exchanged never meet.

Roles: ``kv_both`` loads and saves (reuse across requests and restarts); ``kv_producer`` only saves, and its step
returns once its chunks are in the pool, so a decode engine asked next finds them; ``kv_consumer`` only loads.
"""

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpool.errors import ConfigError, KvPoolError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import Namespace
from kvpool.pool.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.prefill_decode.engine_config import ROLES, ConnectorConfig

log = logging.getLogger(__name__)

RETRY_S = 5.0  #: a side whose etcd or pool could not be reached tries again after this (meanwhile: 0 hits)


def cache_identity(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, tp_rank: int) -> CacheIdentity:
    """What two engines must agree on to exchange KV chunks; computed alike by the scheduler and the workers."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        raise ConfigError(
            f"KvPoolConnector supports models with one attention KV cache group; this model has {len(groups)} "
            f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}): serve it without the connector"
        )
    spec = groups[0].kv_cache_spec
    if config.chunk_size % spec.block_size:
        raise ConfigError(
            f"kv_connector_extra_config.chunk_size ({config.chunk_size}) must be a multiple of vLLM's block size "
            f"({spec.block_size}): e.g. {spec.block_size * max(1, round(config.chunk_size / spec.block_size))}"
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "KvPoolConnector does not support pipeline parallelism yet: serve with pipeline_parallel_size=1"
        )
    backend = getattr(vllm_config.attention_config, "backend", None)
    layout = (
        f"vllm-{vllm.__version__}:{current_platform.device_type}:{backend.name if backend else 'auto'}:"
        f"{type(spec).__name__}:kv_heads={spec.num_kv_heads}:head_size={spec.head_size}:block={spec.block_size}"
    )
    model = config.model_id or vllm_config.model_config.served_model_name
    if isinstance(model, list):
        model = model[0]
    return CacheIdentity(
        model=str(model), kv_dtype=str(spec.dtype).removeprefix("torch."), layout=layout,
        chunk_size=config.chunk_size, tp_size=parallel.tensor_parallel_size, tp_rank=tp_rank,
    )  # fmt: skip


# -- what the scheduler tells the workers, each step ------------------------------------------------------------


@dataclass
class Transfer:
    """Chunks ``[first, end)`` of a request's prompt and the blocks they occupy (``block_ids[i]`` holds tokens
    ``i * block_size ...``).  A load writes only blocks from ``write_from`` on: those before are vLLM's own
    prefix-cache hits, shared with other requests."""

    req_id: str
    tokens: list[int]  #: the prompt's first ``end * chunk_size`` tokens
    first: int
    end: int
    block_ids: list[int]
    write_from: int = 0
    #: a load whose last chunk reaches into what vLLM computes this step (the prompt's last token): done before the
    #: forward starts, so vLLM's own KV write of that token (before attention, not ordered with layer loads) wins
    whole_before_forward: bool = False


@dataclass
class KvPoolMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    lookups: tuple[int, int] = (0, 0)  #: prompt tokens asked for and found in the pool since the last step


@dataclass
class _Request:
    tokens: list[int]
    block_ids: list[int]
    saved: int  #: chunks already in the pool or queued for saving


class KvPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config or {})
        if transfer.kv_role not in ROLES:
            raise ConfigError(
                f"kv_role must be one of {', '.join(ROLES)} for KvPoolConnector, got {transfer.kv_role!r}"
            )
        self.loads_kv = transfer.kv_role in ("kv_both", "kv_consumer")
        self.saves_kv = transfer.kv_role in ("kv_both", "kv_producer")
        if self.config.load_failure == "recompute":
            transfer.kv_load_failure_policy = "recompute"  # a chunk the pool cannot deliver is a miss, not an error
        block_size = vllm_config.cache_config.block_size
        self.side: SchedulerSide | WorkerSide
        if role == KVConnectorRole.SCHEDULER:
            tp = vllm_config.parallel_config.tensor_parallel_size
            identities = [cache_identity(vllm_config, kv_cache_config, self.config, r) for r in range(tp)]
            layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
            self.side = SchedulerSide(self.config, identities, layers, block_size, self.loads_kv, self.saves_kv)
        else:
            identity = cache_identity(vllm_config, kv_cache_config, self.config, _tp_rank())
            self.side = WorkerSide(self.config, identity, block_size, kv_cache_config.num_blocks, self.loads_kv)

    # scheduler side ------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request.request_id), None

    # worker side ---------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_step(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.layer_done(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._worker.end_step(self._meta())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, KvPoolMetadata) and kv_connector_metadata.preempted:
            self._worker.drain(kv_connector_metadata.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        self.side.close()

    @property
    def _scheduler(self) -> "SchedulerSide":
        assert isinstance(self.side, SchedulerSide), "a scheduler-side call on the worker-side connector"
        return self.side

    @property
    def _worker(self) -> "WorkerSide":
        assert isinstance(self.side, WorkerSide), "a worker-side call on the scheduler-side connector"
        return self.side

    def _meta(self) -> KvPoolMetadata:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else KvPoolMetadata()
        assert isinstance(meta, KvPoolMetadata)
        return meta


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):  # no TP group initialised
        return 0


class SchedulerSide:
    """Lookups in the watch cache and the per-step plan of loads and saves."""

    def __init__(
        self, config: ConnectorConfig, identities: list[CacheIdentity], layers: int, block_size: int,
        loads_kv: bool = True, saves_kv: bool = True,
    ) -> None:  # fmt: skip
        self.config, self.identities, self.layers, self.block_size = config, identities, layers, block_size
        self.loads_kv, self.saves_kv = loads_kv, saves_kv
        self.chunk = config.chunk_size
        self.cache: MetadataCache | None = None
        self._connecting = threading.Lock()
        self._next_try = 0.0
        self._hits: dict[str, tuple[int, int]] = {}  #: req id → (tokens vLLM had computed, tokens the pool has)
        self._loads: dict[str, tuple[int, int]] = {}  #: req ids that will load, and what
        self._reqs: dict[str, _Request] = {}
        self._saving: set[str] = set()  #: requests with saves sent to the workers
        self._asked = self._found = 0
        self._connect()

    def _connect(self) -> None:
        """Start the watch cache on a thread (etcd may be down: until it answers, every lookup is 0 hits)."""
        if self.cache is not None or time.monotonic() < self._next_try or not self._connecting.acquire(blocking=False):
            return
        self._next_try = time.monotonic() + RETRY_S

        def connect() -> None:
            try:
                etcd = EtcdClient(self.config.metadata())
                try:
                    self.cache = MetadataCache(etcd, Namespace(self.config.cluster)).start()
                except BaseException:
                    etcd.close()
                    raise
            except KvPoolError as exc:
                log.warning("kvpool: no pool metadata yet (%s); 0 hits until etcd answers", exc)
            finally:
                self._connecting.release()

        threading.Thread(target=connect, name="kvpool-connector-etcd", daemon=True).start()

    def held_chunks(self, tokens: list[int], limit: int) -> int:
        """Leading chunks of ``tokens`` (at most ``limit``) whose every layer, on every TP rank, the pool holds."""
        cache = self.cache
        if cache is None:
            self._connect()
            return 0
        held = limit
        for identity in self.identities:
            keys = chunk_keys(identity, tokens[: limit * self.chunk])
            for layer in range(self.layers):
                held = min(held, cache.lookup_prefix([layer_key(k, layer) for k in keys[:held]]))
                if held == 0:
                    return 0
        return held

    def matched(self, request: Any, num_computed: int) -> int:
        tokens = list(request.prompt_token_ids or [])
        if not self.loads_kv and not self.saves_kv:
            return 0
        held = self.held_chunks(tokens, len(tokens) // self.chunk)
        self._hits[request.request_id] = (num_computed, held * self.chunk)
        if not self.loads_kv:
            return 0
        # vLLM computes at least the last prompt token itself: a prompt whose every chunk is held loads them all
        # and has vLLM compute its last token again (its KV slot is then written twice, with the same values)
        found = min(held * self.chunk, len(tokens) - 1)
        self._asked += len(tokens)
        self._found += found
        return max(found - num_computed, 0)

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            computed, _ = self._hits[request.request_id]
            self._loads[request.request_id] = (computed, computed + num_external_tokens)

    def build(self, out: Any) -> KvPoolMetadata:
        meta = KvPoolMetadata(preempted=set(getattr(out, "preempted_req_ids", None) or ()))
        meta.lookups, self._asked, self._found = (self._asked, self._found), 0, 0
        bpc = self.chunk // self.block_size
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            _, in_pool = self._hits.pop(new.req_id, (0, 0))
            req = self._reqs[new.req_id] = _Request(tokens, list(new.block_ids[0]), in_pool // self.chunk)
            computed[new.req_id] = new.num_computed_tokens
            if (load := self._loads.pop(new.req_id, None)) is not None:
                meta.loads.append(self._transfer(new.req_id, req, load, bpc))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._reqs.get(req_id)
            if running is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption every block is new (its saves were drained)
                running.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                running.block_ids += new_blocks[0]
            computed[req_id] = cached.num_computed_tokens[i]
            if (load := self._loads.pop(req_id, None)) is not None:
                meta.loads.append(self._transfer(req_id, running, load, bpc))
        if self.saves_kv:
            for req_id, done in computed.items():
                req = self._reqs[req_id]
                after = min(done + out.num_scheduled_tokens.get(req_id, 0), len(req.tokens))
                full = min(after // self.chunk, len(req.block_ids) // bpc)
                if full > req.saved:
                    meta.saves.append(
                        Transfer(req_id, req.tokens[: full * self.chunk], req.saved, full, req.block_ids[: full * bpc])
                    )
                    req.saved = full
                    self._saving.add(req_id)
        self._loads.clear()
        return meta

    def _transfer(self, req_id: str, req: _Request, load: tuple[int, int], bpc: int) -> Transfer:
        computed, end_token = load
        first, end = computed // self.chunk, -(-end_token // self.chunk)  # the last chunk may end 1 token later
        return Transfer(
            req_id, req.tokens[: end * self.chunk], first, end, req.block_ids[: end * bpc],
            write_from=computed // self.block_size, whole_before_forward=end * self.chunk > end_token,
        )  # fmt: skip

    def finished(self, req_id: str) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report its saves done."""
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True
        return False

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache.etcd.close()


@dataclass
class _Layer:
    name: str
    index: int
    kv: torch.Tensor
    block_dim: int  #: the dimension of ``kv`` that indexes blocks

    def blocks(self, ids: list[int], out: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` copied into ``out`` (a host buffer of at least their bytes), block-major:
        ``[len(ids), *one block]``."""
        index = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        dest = self.view(out, len(ids))
        if self.block_dim == 0 and self.kv.device == dest.device:
            torch.index_select(self.kv, 0, index, out=dest)
        else:
            dest.copy_(self.kv.index_select(self.block_dim, index).movedim(self.block_dim, 0))
        return dest

    def view(self, buffer: torch.Tensor, blocks: int) -> torch.Tensor:
        """The first ``blocks`` blocks' worth of a flat uint8 ``buffer``, as ``[blocks, *one block]`` of our dtype."""
        return buffer[: blocks * self.block_bytes].view(self.kv.dtype).view(blocks, *self.block_shape)

    def write(self, ids: list[int], data: torch.Tensor) -> None:
        """Put block-major ``data`` (as :meth:`blocks` gives it) into blocks ``ids``."""
        index = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(self.block_dim, index, data.to(self.kv.device).movedim(0, self.block_dim))

    @property
    def block_shape(self) -> list[int]:
        return [n for d, n in enumerate(self.kv.shape) if d != self.block_dim]

    @property
    def block_bytes(self) -> int:
        return self.kv.numel() // self.kv.shape[self.block_dim] * self.kv.element_size()


class WorkerSide:
    """Moves bytes between vLLM's paged KV and the pool on one I/O thread (a PoolClient is used by one thread)."""

    def __init__(
        self, config: ConnectorConfig, identity: CacheIdentity, block_size: int, num_blocks: int, loads_kv: bool = True
    ) -> None:
        self.config, self.identity, self.block_size, self.num_blocks = config, identity, block_size, num_blocks
        self.loads_kv = loads_kv
        self.bpc = config.chunk_size // block_size  #: blocks per chunk
        self.layers: dict[str, _Layer] = {}
        self.client: Any = None
        self._next_try = 0.0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvpool-connector-io")
        self._layer_ready: dict[str, threading.Event] = {}
        self._load: Future[None] | None = None
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._buffers: dict[str, torch.Tensor] = {}  #: reused host staging ("load", "save"), grown as needed
        self._queued: list[tuple[_Layer, Transfer]] = []  #: layers to save, taken together by the next _put
        self._unsaved: dict[str, int] = {}  #: per request, queued layer saves not yet put
        self._saving = threading.Lock()
        self._finished: set[str] = set()  #: requests vLLM finished, whose saves may still run
        self._pending_report: dict[str, float] = {}  #: counts not yet handed to the pool client (metrics)
        self.totals: dict[str, float] = {}  #: every count since the start (tokens, bytes, seconds, errors)
        self._counting = threading.Lock()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for index, (name, kv) in enumerate(kv_caches.items()):
            dims = [d for d, n in enumerate(kv.shape) if n == self.num_blocks]
            if not dims:
                raise ConfigError(
                    f"KvPoolConnector: layer {name}'s KV tensor {tuple(kv.shape)} has no dimension of "
                    f"{self.num_blocks} blocks; this attention backend's layout is not supported"
                )
            self.layers[name] = _Layer(name, index, kv, dims[0])
        self._io.submit(self._pool)  # connect now (Ray, etcd, the transport), not in the first request's step

    # -- the pool client, made on the I/O thread when first needed --------------------------------------------

    def _pool(self) -> Any:
        """The PoolClient (None while the pool cannot be reached; tried again every ``RETRY_S``)."""
        if self.client is not None or time.monotonic() < self._next_try:
            return self.client
        self._next_try = time.monotonic() + RETRY_S
        try:
            import ray

            from kvpool.pool.client import PoolClient
            from kvpool.pool.config import PoolConfig

            if not ray.is_initialized():
                kw: dict[str, Any] = {"_node_ip_address": self.config.node_ip} if self.config.node_ip else {}
                ray.init(address=self.config.ray_address, namespace=self.config.namespace,
                         logging_level=logging.WARNING, log_to_driver=False, **kw)  # fmt: skip
            pool = PoolConfig(metadata=self.config.metadata(), namespace=self.config.namespace)
            self.client = PoolClient(pool)
        except (KvPoolError, ConnectionError, RuntimeError) as exc:
            log.warning("kvpool: pool not reachable (%s); loads miss and saves are skipped until it is", exc)
        return self.client

    # -- a step: loads before the forward, saves as layers finish ---------------------------------------------

    def start_step(self, meta: KvPoolMetadata) -> None:
        self._load = None
        if meta.lookups != (0, 0):
            self._count(lookup_tokens=meta.lookups[0], hit_tokens=meta.lookups[1])
        if not meta.loads or not self.layers:
            self._layer_ready = {}
            return
        self._layer_ready = {name: threading.Event() for name in self.layers}
        self._load = self._io.submit(self._load_all, meta.loads)
        if any(t.whole_before_forward for t in meta.loads):
            self._load.result()

    def wait_layer(self, layer_name: str) -> None:
        ready = self._layer_ready.get(layer_name)
        if ready is not None:
            ready.wait()

    def _load_all(self, loads: list[Transfer]) -> None:
        started = time.perf_counter()
        loaded_bytes = 0
        try:
            client = self._pool()
            keys = [chunk_keys(self.identity, t.tokens)[t.first : t.end] if client else [] for t in loads]
            failed: list[set[int]] = [set() for _ in loads]  #: chunk indices that did not arrive, per request
            for layer in self.layers.values():
                for t, ks, bad in zip(loads, keys, failed, strict=True):
                    if client is None:
                        bad.update(range(t.first, t.end))
                        continue
                    loaded_bytes += self._load_layer(client, layer, t, ks, bad)
                self._layer_ready[layer.name].set()
            errors = {b for t, bad in zip(loads, failed, strict=True) for b in self._blocks_of(t, bad)}
            with self._errors_lock:
                self._load_errors |= errors
            tokens = sum((t.end - t.first) * self.config.chunk_size for t in loads)
            self._count(loaded_tokens=tokens, loaded_bytes=loaded_bytes, load_errors=len(errors),
                        load_seconds=time.perf_counter() - started)  # fmt: skip
        finally:
            for ready in self._layer_ready.values():
                ready.set()  # never leave a layer waiting

    def _load_layer(self, client: Any, layer: _Layer, t: Transfer, keys: list[bytes], bad: set[int]) -> int:
        """Load one layer of ``t``'s chunks into a reused staging buffer, then into the paged blocks; the indices
        of chunks that did not come are added to ``bad``."""
        bpc = self.bpc
        staging = layer.view(self._buffer(client, "load", len(keys) * bpc * layer.block_bytes), len(keys) * bpc)
        views = [staging[i * bpc : (i + 1) * bpc] for i in range(len(keys))]
        lkeys = [layer_key(k, layer.index) for k in keys]
        try:
            client.get_into_batch(lkeys, views)
        except KvPoolError:  # find out which: each on its own
            for i, (k, v) in enumerate(zip(lkeys, views, strict=True)):
                try:
                    client.get_into(k, v)
                except KvPoolError:
                    bad.add(t.first + i)
        rows = [
            i * bpc + j
            for i in range(len(keys))
            if t.first + i not in bad
            for j in range(bpc)
            if (t.first + i) * bpc + j >= t.write_from
        ]
        if rows:
            ids = [t.block_ids[t.first * bpc + r] for r in rows]
            layer.write(ids, staging if len(rows) == len(staging) else staging[rows])
        return len(rows) * layer.block_bytes

    def _buffer(self, client: Any, name: str, nbytes: int) -> torch.Tensor:
        """A reused flat host buffer of at least ``nbytes`` (no page faults per step).  Registered with the
        transport once the client has one, so reads from other nodes land in it without a second copy."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            if buf is not None and client.registrations:
                client.unregister_buffer(buf)
            buf = self._buffers[name] = torch.empty(
                max(nbytes, 2 * (0 if buf is None else buf.numel())), dtype=torch.uint8
            )
        if client.registrations and name == "load":
            client.register_buffer(buf)  # a no-op once registered
        return buf

    def _blocks_of(self, t: Transfer, bad: set[int]) -> list[int]:
        bpc = self.bpc
        return [t.block_ids[b] for c in sorted(bad) for b in range(c * bpc, (c + 1) * bpc) if b >= t.write_from]

    def layer_done(self, layer_name: str, meta: KvPoolMetadata) -> None:
        """A layer has been computed: queue its chunks of this step's saves (the forward pass goes on).  The
        step's end hands the queue to the I/O thread as one batch: two node calls and one etcd transaction for
        every layer, where a put per layer cost 30 of each for a 30-layer model and a producer's step waited for
        all of them."""
        layer = self.layers.get(layer_name)
        if layer is None or not meta.saves:
            return
        with self._saving:
            for t in meta.saves:
                self._queued.append((layer, t))
                self._unsaved[t.req_id] = self._unsaved.get(t.req_id, 0) + 1

    def _put(self) -> None:
        with self._saving:
            batch, self._queued = self._queued, []
        if not batch:
            return  # an earlier _put took this layer's saves with its own
        started = time.perf_counter()
        try:
            client = self._pool()
            if client is None:
                self._count(save_errors=len(batch))
                return
            bpc = self.bpc
            buf = self._buffer(client, "save", sum((t.end - t.first) * bpc * layer.block_bytes for layer, t in batch))
            items, at = [], 0
            for layer, t in batch:
                data = layer.blocks(t.block_ids[t.first * bpc : t.end * bpc], buf[at:])
                at += data.numel() * data.element_size()
                keys = chunk_keys(self.identity, t.tokens)[t.first : t.end]
                items += [(layer_key(k, layer.index), data[i * bpc : (i + 1) * bpc]) for i, k in enumerate(keys)]
            try:
                client.put_batch(items, replicas=self.config.replicas)
            except KvPoolError as exc:  # a full pool, etcd or a node gone: a future miss, never an engine error
                log.warning("kvpool: could not save %d chunk layers: %s", len(items), exc)
                self._count(save_errors=len(batch))
                return
            self._count(saved_tokens=sum((t.end - t.first) * self.config.chunk_size for _, t in batch), saved_bytes=at,
                        save_seconds=time.perf_counter() - started)  # fmt: skip
        finally:
            with self._saving:
                for _, t in batch:
                    self._unsaved[t.req_id] -= 1

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

    def take_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _count(self, **counts: float) -> None:
        """Add to what this worker reports to its pool node's metrics (kvpool_engine_*)."""
        with self._counting:
            for name, n in counts.items():
                self._pending_report[name] = self._pending_report.get(name, 0) + n
                self.totals[name] = self.totals.get(name, 0) + n
            client = self.client
            if client is None or not threading.current_thread().name.startswith("kvpool-connector-io"):
                return  # the client is used on its I/O thread only: reported with the next count made there
            pending, self._pending_report = self._pending_report, {}
        client.record_engine(pending)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._io.submit(self._close_client).result(timeout=30)
        self._io.shutdown(wait=False)

    def _close_client(self) -> None:
        if self.client is not None:
            if self._pending_report:
                self.client.record_engine(self._pending_report)
            self.client.close()
            self.client = None
