"""How a model's KV cache is cut into pool chunks, and put back together.

A chunk holds the K and V of ``T`` consecutive tokens (``T`` = the chunk size), token-major so that the
chunks of a prefix, laid end to end, *are* the cache:

- ``all-layers``: one pool object per chunk, ``[T, L, 2, H, D]`` (tokens, layers, K/V, KV heads, head dim);
- ``per-layer``: one pool object per chunk and layer, ``[T, 2, H, D]``, keyed by
  :func:`kvpool.core.keys.layer_key`, so layer ``l+1`` can be fetched while layer ``l`` computes;
- ``groups-of-G``: one pool object per chunk and group of ``G`` consecutive layers, ``[T, G, 2, H, D]``, keyed by
  the group's index: ``G`` times fewer objects (and placements) than per-layer, still fetched group by group
  while the model computes the group before;
- ``auto`` (the default): ``groups-of-G`` with the most layers per object that keep an object within
  :data:`AUTO_OBJECT_BYTES` and leave at least two groups to pipeline (``per-layer`` when one layer is already that
  big).  On this project's CPU runs 512 KiB objects gave the fastest warm request, faster than per-layer
  (128 KiB) and all-layers (1 MiB, nothing to pipeline): docs/figures.md, row ttft-layouts.  The layout a cache
  uses is resolved once, so ``auto`` never appears in a cache identity.

A :class:`KVBuffer` is one host tensor for a whole prefix, ``[L/G, N, G, 2, H, D]`` (``G`` layers per object:
``[N, L, 2, H, D]`` for all-layers, ``[L, N, 2, H, D]`` for per-layer).
Chunks are read from the pool straight into their slice of it, and the ``DynamicCache`` built from it
holds *views* — ``K_l = buffer[..., l, 0, :, :].permute(1, 0, 2)`` is ``[H, N, D]`` with no copy — so
it can be handed to the model before the chunks have arrived.  transformers copies once, when the first
new token is appended to each layer.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
from msgspec import Meta
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvpool.core.config import Positive, checked
from kvpool.core.keys import DEFAULT_CHUNK_SIZE, CacheIdentity, chunk_keys, layer_key
from kvpool.errors import ConfigError
from kvpool.pool.tenants import Scope

LAYOUTS = ("auto", "all-layers", "per-layer", "groups-of-G")  #: G: layers per object, a divisor of the model's layers
AUTO_OBJECT_BYTES = 512 << 10  #: the largest pool object ``auto`` makes of several layers


def auto_layout(layers: int, layer_object_bytes: int) -> str:
    """What ``auto`` means for a model of ``layers`` layers whose objects hold ``layer_object_bytes`` per layer."""
    fits = [g for g in range(1, layers // 2 + 1) if layers % g == 0 and g * layer_object_bytes <= AUTO_OBJECT_BYTES]
    group = max(fits, default=1)
    return "per-layer" if group == 1 else f"groups-of-{group}"


def layers_per_object(layout: str, layers: int) -> int:
    """How many layers one pool object of ``layout`` holds, for a model of ``layers`` layers."""
    if layout == "all-layers":
        return layers
    if layout == "per-layer":
        return 1
    group = layout.removeprefix("groups-of-")
    if not group.isdigit() or not 0 < int(group) <= layers or layers % int(group):
        raise ConfigError(
            f"layout must be auto, all-layers, per-layer or groups-of-G with G a divisor of the model's {layers} layers, "
            f"got {layout!r}"
        )
    return int(group)


@checked
@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's KV cache in the pool; its fields are checked when it is made."""

    layers: Positive
    kv_heads: Positive
    head_dim: Positive
    dtype: torch.dtype
    chunk_size: Positive = DEFAULT_CHUNK_SIZE
    #: resolved to a concrete layout when made
    layout: Annotated[str, Meta(description=f"one of {', '.join(LAYOUTS)}")] = "auto"

    def __post_init__(self) -> None:
        if self.layout == "auto":
            per_layer = self.chunk_size * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
            object.__setattr__(self, "layout", auto_layout(self.layers, per_layer))
        layers_per_object(self.layout, self.layers)

    @classmethod
    def of(cls, model: Any, *, chunk_size: int = DEFAULT_CHUNK_SIZE, layout: str = "auto") -> "KVLayout":
        """The layout of a transformers causal LM's cache (its config and parameter dtype)."""
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        dtype = next(model.parameters()).dtype
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, dtype, chunk_size, layout)

    @property
    def group(self) -> int:
        """Layers per pool object."""
        return layers_per_object(self.layout, self.layers)

    @property
    def groups(self) -> int:
        """Pool objects per chunk: fetched one after the other, each group's while the group before computes."""
        return self.layers // self.group

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token, all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def object_bytes(self) -> int:
        """Bytes of one pool object: a chunk of its group of layers."""
        return self.chunk_size * self.token_bytes // self.groups

    def shape_string(self) -> str:
        dims = {1: "T,2,H,D", self.layers: "T,L,2,H,D"}.get(self.group, f"T,{self.group},2,H,D")
        return f"{self.layout}:[{dims}] L={self.layers} H={self.kv_heads} D={self.head_dim}"

    def identity(self, model: str, *, tp_size: int = 1, tp_rank: int = 0, codec: str = "raw") -> CacheIdentity:
        """The cache identity (the root of the key chain): the layout is part of it."""
        dtype = str(self.dtype).removeprefix("torch.")
        return CacheIdentity(model, dtype, self.shape_string(), self.chunk_size, tp_size, tp_rank, codec)

    def keys(self, identity: CacheIdentity, tokens: Any, scope: Scope | None = None) -> list[list[bytes]]:
        """Per full chunk of ``tokens``, the keys of its pool objects: one (all-layers) or one per group of layers;
        ``scope``: a tenant's chain (:mod:`kvpool.pool.tenants`)."""
        if identity.chunk_size != self.chunk_size:
            raise ConfigError(f"identity chunk size {identity.chunk_size} != layout chunk size {self.chunk_size}")
        chain = chunk_keys(identity, tokens, scope)
        if self.groups == 1:
            return [[k] for k in chain]
        return [[layer_key(k, g) for g in range(self.groups)] for k in chain]


class KVBuffer:
    """Host memory for the KV of ``chunks`` whole chunks, and the cache that views it."""

    def __init__(
        self, layout: KVLayout, chunks: int, *, storage: torch.Tensor | None = None, pin: bool = False
    ) -> None:
        """``pin``: page-locked host memory (a CUDA device can then copy into it without blocking)."""
        self.layout = layout
        self.chunks = chunks
        tokens = chunks * layout.chunk_size
        lay = layout
        shape = (lay.groups, tokens, lay.group, 2, lay.kv_heads, lay.head_dim)
        numel = int(np.prod(shape))
        if storage is None:
            storage = torch.empty(numel, dtype=lay.dtype, pin_memory=pin)
        elif storage.dtype != lay.dtype or storage.numel() < numel or not storage.is_contiguous():
            raise ConfigError(f"storage must be a contiguous {lay.dtype} tensor of at least {numel} elements")
        self.tensor = storage[:numel].view(shape)

    def object_views(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(chunk, group, view)`` for every pool object, in the order :meth:`KVLayout.keys` names them; each view
        is contiguous, ready for ``get_into``."""
        t = self.layout.chunk_size
        for c in range(self.chunks):
            for g in range(self.layout.groups):
                yield c, g, self.tensor[g, c * t : (c + 1) * t]

    def layer_kv(self, layer: int, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of one layer, ``[1, H, N, D]`` each, as transformers expects them (the first
        ``tokens`` positions only, when given)."""
        per = self.tensor[layer // self.layout.group, :, layer % self.layout.group]  # [N, 2, H, D]
        per = per[:tokens]
        return per[:, 0].permute(1, 0, 2).unsqueeze(0), per[:, 1].permute(1, 0, 2).unsqueeze(0)

    def to_cache(self, tokens: int | None = None) -> DynamicCache:
        """A ``DynamicCache`` over this buffer's first ``tokens`` positions (default: all), with no copy:
        writes into the buffer show through, so the cache can be made before the chunks arrive.

        ``DynamicCache(pairs)`` would copy each pair in (it appends them to empty layers), so the layers
        are set up here and handed their views.
        """
        layers: list[Any] = []
        for index in range(self.layout.layers):
            k, v = self.layer_kv(index, tokens)
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            layers.append(layer)
        cache = DynamicCache()
        cache.layers = layers
        return cache

    def fill_from(self, cache: DynamicCache, first_chunk: int = 0, *, non_blocking: bool = False) -> None:
        """Copy chunks ``first_chunk ..`` of a cache (batch of one, on any device) into this buffer, chunk 0
        of the buffer being ``first_chunk`` of the cache.  ``non_blocking`` from a CUDA cache into a pinned
        buffer returns before the copy is done: wait on an event recorded after it."""
        t = self.layout.chunk_size
        start, stop = first_chunk * t, (first_chunk + self.chunks) * t
        for layer in range(self.layout.layers):
            held: Any = cache.layers[layer]
            k, v = held.keys, held.values
            if k is None or v is None or k.shape[0] != 1 or k.shape[-2] < stop:
                raise ConfigError(f"layer {layer} of the cache holds fewer than {stop} tokens of one sequence")
            dk, dv = self.layer_kv(layer)
            dk.copy_(k[..., start:stop, :], non_blocking=non_blocking)
            dv.copy_(v[..., start:stop, :], non_blocking=non_blocking)
