"""kvpool: a distributed memory pool for LLM KV caches.

The components live in sub-packages: ``kvpool.metadata`` (etcd), ``kvpool.pool`` (segments, the
``PoolNode`` actor, the client), ``kvpool.transport`` (NIXL/UCX) and ``kvpool.prefill_decode`` (workers
around a real model).  This root package holds only what every layer shares: the exception hierarchy
and the clock.
"""

from kvpool.errors import (
    ChunkBusy,
    ChunkNotFound,
    ConfigError,
    CorruptChunk,
    KvPoolError,
    MalformedRecord,
    MetadataUnavailable,
    NodeUnreachable,
    PoolFull,
    TransferError,
)

__version__ = "0.1.0"

__all__ = [
    "ChunkBusy",
    "ChunkNotFound",
    "ConfigError",
    "CorruptChunk",
    "KvPoolError",
    "MalformedRecord",
    "MetadataUnavailable",
    "NodeUnreachable",
    "PoolFull",
    "TransferError",
    "__version__",
]
