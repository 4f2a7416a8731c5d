"""What the pool stores of a model's KV cache, seen alike by the connector's scheduler and worker sides: vLLM's
KV-cache groups (its hybrid KV manager: one group per kind of layer) turned into the pool's layers and, for each,
which blocks of a chunk it needs.

- a full-attention layer (MLA included) stores every block of every chunk;
- a sliding-window layer stores, of each chunk, only the blocks a prefix ending at that chunk's end still attends
  to (its ``tail``: the last ``ceil(window / block_size)`` blocks), and a prefix hit needs those of the chunks
  inside the window of its end only (:meth:`KvGroups.first_chunk`);
- a state layer (Mamba, linear attention) holds one running state per request, valid at one token count only:
  vLLM's CPU engine never keeps it at chunk ends, so a model with one is served without the pool
  (:attr:`KvGroups.unserved` says why).

MLA's latent KV is the same on every tensor-parallel rank (:attr:`KvGroups.replicated`): one copy is stored for
all ranks, written by rank 0."""

from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError

NULL_BLOCK = 0  #: vLLM's null block (its block pool's first): a position a sliding window left; never read or written


@dataclass(frozen=True)
class PoolLayer:
    """One layer the pool stores: its objects are ``layer_key(chunk key, index)``."""

    name: str
    index: int
    group: int  #: its KV-cache group: which of a request's block-id lists holds its blocks
    window: int = 0  #: its sliding window, in tokens (0: full attention)


@dataclass(frozen=True)
class KvGroups:
    layers: tuple[PoolLayer, ...]
    block_size: int  #: of the stored layers' groups (all alike)
    chunk_size: int
    layout: str = ""  #: the stored groups' specs, for the cache identity
    kv_dtype: str = ""  #: the stored layers' dtype(s), for the cache identity
    replicated: bool = False  #: MLA: the same KV on every TP rank, stored once
    unserved: str = ""  #: why the pool serves this model nothing ("": it does)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def tail(self, layer: PoolLayer) -> int:
        """How many of a chunk's last blocks ``layer`` stores (every block but for a sliding window)."""
        bpc = self.blocks_per_chunk
        return min(bpc, -(-layer.window // self.block_size)) if layer.window else bpc

    def first_chunk(self, layer: PoolLayer, end: int) -> int:
        """The first chunk ``layer`` needs of a prefix of ``end`` chunks (0 but for a sliding window: the first
        chunk inside the window of the prefix's end, or of the token before it)."""
        return max(0, (end * self.chunk_size - layer.window) // self.chunk_size) if layer.window else 0

    @classmethod
    def of(cls, kv_cache_config: Any, chunk_size: int) -> "KvGroups":
        """The groups of vLLM's ``KVCacheConfig`` (the same on the scheduler and the workers)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

        layers: list[PoolLayer] = []
        kinds: list[str] = []
        unserved: list[str] = []
        block_sizes: set[int] = set()
        dtypes: set[str] = set()
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                window = spec.sliding_window + spec.extra_retained_tokens
            elif isinstance(spec, FullAttentionSpec):
                window = 0
            else:
                unserved.append(
                    f"its {type(spec).__name__} layers ({', '.join(group.layer_names)}) hold a running state, which "
                    "vLLM's engine keeps at no chunk's end"
                )
                continue
            block_sizes.add(spec.block_size)
            dtypes.add(str(spec.dtype).removeprefix("torch."))
            layers += [PoolLayer(name, len(layers) + i, gid, window) for i, name in enumerate(group.layer_names)]
            kind = f"{type(spec).__name__}:kv_heads={spec.num_kv_heads}:head_size={spec.head_size}"
            kinds.append(f"{kind}:block={spec.block_size}" + (f":window={window}" if window else ""))
        if len(block_sizes) > 1:
            unserved.append(f"its attention groups have different block sizes {sorted(block_sizes)}")
        block_size = min(block_sizes, default=chunk_size)
        if not unserved and chunk_size % block_size:
            raise ConfigError(
                f"kv_connector_extra_config.chunk_size ({chunk_size}) must be a multiple of vLLM's block size "
                f"({block_size}): e.g. {block_size * max(1, round(chunk_size / block_size))}"
            )
        replicated = bool(kinds) and all(k.startswith(MLAAttentionSpec.__name__) for k in kinds)
        return cls(
            tuple(layers),
            block_size,
            chunk_size,
            layout="+".join(sorted(set(kinds))),
            kv_dtype=",".join(sorted(dtypes)),
            replicated=replicated,
            unserved="; ".join(unserved),
        )
