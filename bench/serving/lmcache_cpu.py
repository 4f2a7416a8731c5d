"""LMCache 0.5.6 inside vLLM on the CPU: the KV copies LMCache has no connector for, in plain torch.

Stock LMCache builds its "GPU connector" (what copies between vLLM's paged KV cache and its own memory objects) in
``lmcache.v1.gpu_connector.CreateGPUConnector``, which has vLLM branches for cuda, xpu, musa and hpu only: on a CPU
it raises, and LMCache runs "in degraded mode (recompute)", storing and loading nothing.  Its CUDA connector cannot
stand in (CUDA streams, a CUDA device assert), nor its torch fallback kernel (no head-major layouts, which vLLM's CPU
attention allocates).  :class:`CpuKVConnector` makes those copies; :class:`LMCacheConnectorV1`, vLLM's own connector,
puts it in LMCache's factory just before LMCache builds anything.  Engines load it with

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                           "kv_connector_module_path": "kvpool.bench.serving.lmcache_cpu"}'

so it runs in whichever process builds a connector (the API server's EngineCore: scheduler and worker).  Only
LMCache's plain path: no MLA, layerwise, blending or connector V3.

This module never imports LMCache at its top: LMCache loads numba and llvmlite, and vLLM's triton-override scan at
worker start-up (``vllm/triton_utils/dispatcher.py``) fails on llvmlite's objects if they are loaded before it.

Layouts (vLLM CPU 0.32, attention backend CPU_ATTN):
- vLLM: one tensor per layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, which ``cpu_attn.py`` views
  as ``[B, H, 2 * N, C]`` and halves on dim 2; so its memory is ``[B, H, 2 (K, V), N, C]``.
- LMCache: memory objects in ``KV_2LTD``, ``[2 (K, V), num_layers, num_tokens, H * C]``.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1 as VllmLMCacheConnectorV1,
)

from kvpool.errors import ConfigError, KvPoolError

log = logging.getLogger(__name__)


class UncopyableKV(KvPoolError):
    """A copy this connector cannot make: vLLM's KV cache is not the CPU layout it knows, an LMCache memory object is
    not ``KV_2LTD``, or a token to store has no slot.  LMCache logs it and treats the chunks as not stored or loaded
    (the engine recomputes them); check that the engine runs vLLM's CPU attention backend."""


@dataclass(frozen=True)
class Run:
    """Tokens ``token .. token + length`` of a copy (counted from its ``start``), which sit in consecutive slots of
    one block: ``offset .. offset + length`` of block ``block``."""

    token: int
    block: int
    offset: int
    length: int


def block_runs(slots: Sequence[int], block_size: int, skip: int = 0) -> list[Run]:
    """The runs of ``slots`` (one slot per token, ``block * block_size + offset``), leaving out the first ``skip``
    tokens and any slot below 0 (a token vLLM gave no slot)."""
    runs: list[Run] = []
    i = skip
    while i < len(slots):
        slot = slots[i]
        if slot < 0:
            i += 1
            continue
        block, offset = divmod(slot, block_size)
        length = 1
        while i + length < len(slots) and offset + length < block_size and slots[i + length] == slot + length:
            length += 1
        runs.append(Run(i, block, offset, length))
        i += length
    return runs


class PagedCpuKV:
    """vLLM's per-layer CPU KV tensors, each viewed as ``[B, H, 2, N, C]``, copied to and from ``KV_2LTD`` tensors
    one run of a block at a time.  Small copies on purpose: torch makes them without an OpenMP region, where one
    gather per layer ran an OpenMP region that competed with the engine's own threads (10-20x slower on 2 cores)."""

    def __init__(self, caches: Sequence[torch.Tensor], num_kv_heads: int, head_size: int) -> None:
        self.heads, self.head_size = num_kv_heads, head_size
        self.caches = list(caches)  #: vLLM's own tensors, each [B, H, N, 2 * C]
        self.layers = [self._view(t) for t in caches]  #: the same memory, each [B, H, 2, N, C]

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        expected = (self.heads, 2 * self.head_size)
        if t.dim() != 4 or (t.shape[1], t.shape[3]) != expected or not t.is_contiguous():
            raise UncopyableKV(
                f"vLLM's KV cache of a layer is {tuple(t.shape)} (strides {t.stride()}): expected a contiguous "
                f"[num_blocks, {self.heads}, block_size, {2 * self.head_size}], vLLM CPU's layout"
            )
        blocks, heads, block_size, _ = t.shape
        return t.view(blocks, heads, 2, block_size, self.head_size)

    @property
    def block_size(self) -> int:
        return int(self.layers[0].shape[3])

    def store(self, out: torch.Tensor, runs: Sequence[Run]) -> None:
        """The tokens of ``runs`` copied from the paged cache into ``out``, ``[2, L, T, H * C]``."""
        for layer, kv in enumerate(self.layers):
            dst = out[:, layer]  # [2, T, H * C]
            for r in runs:
                src = kv[r.block, :, :, r.offset : r.offset + r.length]  # [H, 2, r, C]
                dst[:, r.token : r.token + r.length].view(2, r.length, self.heads, -1).copy_(src.permute(1, 2, 0, 3))

    def load(self, src: torch.Tensor, runs: Sequence[Run]) -> None:
        """The tokens of ``runs`` copied from ``src``, ``[2, L, T, H * C]``, into the paged cache."""
        for layer, kv in enumerate(self.layers):
            chunk = src[:, layer]  # [2, T, H * C]
            for r in runs:
                tokens = chunk[:, r.token : r.token + r.length].view(2, r.length, self.heads, -1)  # [2, r, H, C]
                kv[r.block, :, :, r.offset : r.offset + r.length].copy_(tokens.permute(2, 0, 1, 3))


class CpuKVConnector:
    """LMCache's ``GPUConnectorInterface`` (registered as one by :func:`install`) for vLLM's CPU KV cache: LMCache
    passes ``kvcaches`` (vLLM's layers, in order) and ``slot_mapping`` (one slot per token of the whole request) with
    every call, and ``vllm_cached_tokens`` with loads."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.kvcaches: list[torch.Tensor] | None = None  # LMCache's name; its internal API server reads it
        self._paged: PagedCpuKV | None = None

    @classmethod
    def from_metadata(cls, metadata: Any) -> "CpuKVConnector":
        """From LMCache's engine metadata, whose ``kv_shape`` is ``(layers, 2, chunk_size, kv_heads, head_size)``."""
        if metadata.use_mla:
            raise ConfigError("use_mla: kvpool's CPU connector for LMCache copies K and V layouts only, not MLA's")
        layers, _, _, heads, head_size = metadata.kv_shape
        return cls(layers, heads, head_size)

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])

    def _paged_kv(self, kwargs: dict[str, Any]) -> PagedCpuKV:
        self.initialize_kvcaches_ptr(**kwargs)
        if not self.kvcaches:
            raise UncopyableKV("LMCache passed no kvcaches: vLLM's KV cache was never registered")
        paged = self._paged
        if (
            paged is None
            or len(paged.caches) != len(self.kvcaches)
            or any(a is not b for a, b in zip(paged.caches, self.kvcaches, strict=True))
        ):
            if paged is None:
                log.info("kvpool CPU connector: %d layers of %s", len(self.kvcaches), tuple(self.kvcaches[0].shape))
            paged = self._paged = PagedCpuKV(self.kvcaches, self.num_kv_heads, self.head_size)
        return paged

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Store: tokens ``start .. end`` of the request, from vLLM's cache into ``memory_obj``."""
        paged, out = self._paged_kv(kwargs), _kv_2ltd(memory_obj)
        slots = _slots(kwargs, start, end)
        if any(s < 0 for s in slots):
            raise UncopyableKV(f"a token of {start}..{end} to store has no slot in vLLM's KV cache")
        paged.store(out, block_runs(slots, paged.block_size))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Load: ``memory_obj`` into vLLM's cache at tokens ``start .. end`` of the request, except the tokens vLLM's
        own prefix cache already holds (``vllm_cached_tokens``): those blocks may be shared with running requests,
        so they are never written (as LMCache's CUDA connector skips them)."""
        paged, src = self._paged_kv(kwargs), _kv_2ltd(memory_obj)
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        paged.load(src, block_runs(_slots(kwargs, start, end), paged.block_size, skip))

    def batched_from_gpu(
        self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], **kwargs: Any
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Sequence[Any] | None = None,
        starts: Sequence[int] | None = None,
        ends: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        for memory_obj, start, end in zip(memory_objs or (), starts or (), ends or (), strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        """The shape of a memory object of ``num_tokens`` tokens: ``KV_2LTD``."""
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])


def _kv_2ltd(memory_obj: Any) -> torch.Tensor:
    from lmcache.v1.memory_management import MemoryFormat

    if memory_obj.tensor is None or memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
        raise UncopyableKV(f"an LMCache memory object in {memory_obj.metadata.fmt}: expected KV_2LTD")
    tensor: torch.Tensor = memory_obj.tensor
    return tensor


def _slots(kwargs: dict[str, Any], start: int, end: int) -> list[int]:
    if "slot_mapping" not in kwargs:
        raise UncopyableKV("LMCache passed no slot_mapping")
    slots: list[int] = kwargs["slot_mapping"][start:end].to(device="cpu", dtype=torch.long).tolist()
    return slots


_installed = False


def install() -> None:
    """Make LMCache's ``CreateGPUConnector`` give vLLM on the CPU a :class:`CpuKVConnector` (once per process).
    Imports LMCache: call it once the engine builds its connector, never at import."""
    global _installed
    if _installed:
        return
    import lmcache.v1.gpu_connector as factory
    from lmcache.logging import init_logger
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    init_logger(__name__)  # LMCache's handler on this module's logger, so its lines show in the engine's log
    GPUConnectorInterface.register(CpuKVConnector)
    factory.CreateGPUConnector = _create_on_cpu(factory.CreateGPUConnector)
    _installed = True


def _create_on_cpu(create: Callable[..., Any]) -> Callable[..., Any]:
    """``create`` (LMCache's factory), except that vLLM on the CPU gets a :class:`CpuKVConnector`."""
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    def create_gpu_connector(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if engine != EngineType.VLLM or torch_device_type != "cpu":
            return create(config, metadata, engine, layout_hints=layout_hints)
        options = {
            "use_layerwise": config.use_layerwise,
            "enable_blending": config.enable_blending,
            "use_gpu_connector_v3": config.use_gpu_connector_v3,
        }
        if on := [name for name, value in options.items() if value]:
            raise ConfigError(f"{', '.join(on)}: kvpool's CPU connector for LMCache copies LMCache's plain path only")
        log.info("kvpool CPU connector: LMCache's copies for vLLM on the CPU, in torch")
        return CpuKVConnector.from_metadata(metadata)

    return create_gpu_connector


class LMCacheConnectorV1(VllmLMCacheConnectorV1):
    """vLLM's LMCache connector, with LMCache given :class:`CpuKVConnector` just before it builds its engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install()
        super().__init__(*args, **kwargs)
