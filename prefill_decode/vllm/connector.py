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
``[kv_heads, block_size, 2 * head_size]``), keyed by :func:`~kvpool.core.keys.layer_key` of the chunk's
chain key.  The cache identity names the vLLM version, device, attention backend, KV spec, block size,
tensor-parallel rank and the model, so engines whose KV cannot be exchanged never meet.

Roles: ``kv_both`` loads and saves (reuse across requests and restarts); ``kv_producer`` only saves, and its step
returns once its chunks are in the pool, so a decode engine asked next finds them; ``kv_consumer`` only loads.
"""

from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpool.core.keys import CacheIdentity
from kvpool.errors import ConfigError
from kvpool.prefill_decode.vllm.config import ConnectorConfig, kv_role
from kvpool.prefill_decode.vllm.scheduler import KvPoolMetadata, SchedulerSide, Transfer
from kvpool.prefill_decode.vllm.stats import KvPoolPromMetrics, KvPoolStats
from kvpool.prefill_decode.vllm.worker import WorkerSide


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
        model=str(model),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        layout=layout,
        chunk_size=config.chunk_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=tp_rank,
    )


class KvPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config or {})
        kv = kv_role(transfer.kv_role)  # not `role`: that is which side of vLLM this connector is
        self.loads_kv = kv in ("kv_both", "kv_consumer")
        self.saves_kv = kv in ("kv_both", "kv_producer")
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
