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
  ``get_block_ids_with_load_errors`` and vLLM recomputes from there: never wrong KV, never a hung request.  A model
  of several KV-cache groups (vLLM's hybrid manager: the connector is ``SupportsHMA``) loads a request whole before
  vLLM schedules it, and a failed load has vLLM compute the request from its start (``get_transfer_results``).

With vLLM's KV events on (``--kv-events-config``), the engine's event stream also carries the pool's chunks this
engine saved: ``BlockStored`` once a save is in the pool, ``BlockRemoved`` once it is gone, the pool's tier as
``medium`` (:mod:`~kvpool.prefill_decode.vllm.events`).

The pool object of a chunk is one layer of it: the chunk's ``chunk_size / block_size`` blocks laid end to end,
each a block of vLLM's KV tensor for that layer exactly as the attention backend lays it out (on CPU
``[kv_heads, block_size, 2 * head_size]``), keyed by :func:`~kvpool.core.keys.layer_key` of the chunk's
chain key; a sliding-window layer's object holds only the chunk's last blocks its window needs
(:class:`~kvpool.prefill_decode.vllm.groups.KvGroups`).  The cache identity names the vLLM version, device,
attention backend, KV specs, block size, tensor-parallel rank (none for MLA: the same latent KV on every rank, one
copy written by rank 0) and the model, so engines whose KV cannot be exchanged never meet.

Roles: ``kv_both`` loads and saves (reuse across requests and restarts); ``kv_producer`` only saves, and its step
returns once its chunks are in the pool, so a decode engine asked next finds them; ``kv_consumer`` only loads.
"""

import logging
from typing import Any

import torch
import vllm
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpool.core.keys import CacheIdentity
from kvpool.errors import ConfigError
from kvpool.prefill_decode.vllm.config import ConnectorConfig, kv_role
from kvpool.prefill_decode.vllm.events import PoolEvents, PoolKVEvents
from kvpool.prefill_decode.vllm.groups import KvGroups
from kvpool.prefill_decode.vllm.scheduler import KvPoolMetadata, SchedulerSide, Transfer
from kvpool.prefill_decode.vllm.stats import KvPoolPromMetrics, KvPoolStats
from kvpool.prefill_decode.vllm.worker import WorkerSide

log = logging.getLogger(__name__)


def cache_identity(vllm_config: Any, groups: KvGroups, config: ConnectorConfig, tp_rank: int) -> CacheIdentity:
    """What two engines must agree on to exchange KV chunks; computed alike by the scheduler and the workers.  MLA's
    latent KV is the same on every TP rank: its identity names no rank, and engines of any TP size share it."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "KvPoolConnector does not support pipeline parallelism yet: serve with pipeline_parallel_size=1"
        )
    backend = getattr(vllm_config.attention_config, "backend", None)
    layout = (
        f"vllm-{vllm.__version__}:{current_platform.device_type}:{backend.name if backend else 'auto'}:{groups.layout}"
    )
    model = config.model_id or vllm_config.model_config.served_model_name
    if isinstance(model, list):
        model = model[0]
    return CacheIdentity(
        model=str(model),
        kv_dtype=groups.kv_dtype,
        layout=layout,
        chunk_size=config.chunk_size,
        tp_size=1 if groups.replicated else parallel.tensor_parallel_size,
        tp_rank=0 if groups.replicated else tp_rank,
    )


class KvPoolConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config or {})
        kv = kv_role(transfer.kv_role)  # not `role`: that is which side of vLLM this connector is
        self.loads_kv = kv in ("kv_both", "kv_consumer")
        self.saves_kv = kv in ("kv_both", "kv_producer")
        if self.config.load_failure == "recompute":
            transfer.kv_load_failure_policy = "recompute"  # a chunk the pool cannot deliver is a miss, not an error
        groups = KvGroups.of(kv_cache_config, self.config.chunk_size)
        if groups.unserved and role == KVConnectorRole.SCHEDULER:
            log.warning("kvpool: this model is served without the pool: %s", groups.unserved)
        self.side: SchedulerSide | WorkerSide
        if role == KVConnectorRole.SCHEDULER:
            tp = 1 if groups.replicated else vllm_config.parallel_config.tensor_parallel_size
            identities = [cache_identity(vllm_config, groups, self.config, r) for r in range(tp)]
            events_config = getattr(vllm_config, "kv_events_config", None)
            events = None
            if events_config is not None and events_config.enable_kv_cache_events and self.saves_kv:
                events = PoolEvents(groups, kv_cache_config.hash_block_size or groups.block_size, writers=tp)
            self.side = SchedulerSide(self.config, identities, groups, self.loads_kv, self.saves_kv, events)
        else:
            rank = _tp_rank()
            identity = cache_identity(vllm_config, groups, self.config, rank)
            writes = rank == 0 or not groups.replicated  # one copy of replicated KV, from rank 0
            self.side = WorkerSide(self.config, identity, groups, kv_cache_config.num_blocks, self.loads_kv, writes)

    # scheduler side ------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self._scheduler.matched(request, num_computed_tokens)  # None: vLLM asks again later (a prefetch runs)
        return n, n is not None and n > 0 and self._scheduler.async_loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, num_external_tokens, blocks.get_block_ids())

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' reports of chunks they saved (vLLM's KV events on), published once every writer's came."""
        events = connector_output.kv_cache_events
        if self._scheduler.events is not None and isinstance(events, PoolKVEvents):
            self._scheduler.events.confirm(events.get_all_events())

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's chunks saved, moved or gone since the last step, for vLLM's KV-event publisher."""
        side = self._scheduler
        return side.events.take(side.cache) if side.events is not None else []

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request.request_id), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV manager: as :meth:`request_finished`, whatever the groups (vLLM keeps them all)."""
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
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves done, and whole-request loads ended (models of several KV-cache groups, whose failed loads vLLM
        can only take per request: it then computes them from the start)."""
        ended, failed = self._worker.loaded()
        return KVConnectorTransferResults(
            finished_sending=self._worker.finished(finished_req_ids) or set(),
            finished_recving=ended,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> PoolKVEvents | None:
        """The chunks this worker's puts saved since the last step (their ``BlockStored``: :mod:`.events`)."""
        return self._worker.saved.take()

    def get_kv_connector_stats(self) -> KvPoolStats | None:
        """The worker's counts since the last step (the scheduler's travel to the workers with each step's plan)."""
        return self.side.take_stats() if isinstance(self.side, WorkerSide) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvPoolStats:
        return KvPoolStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvPoolPromMetrics:
        return KvPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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


__all__ = ["KvPoolConnector", "KvPoolMetadata", "SchedulerSide", "Transfer", "WorkerSide", "cache_identity"]
