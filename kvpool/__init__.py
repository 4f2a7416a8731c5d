"""kvpool: a distributed memory pool for LLM KV caches.

The components live in sub-packages: ``kvpool.metadata`` (etcd), ``kvpool.pool`` (segments, the
``PoolNode`` actor, the client), ``kvpool.transport`` (NIXL/UCX) and ``kvpool.prefill_decode`` (workers
around a real model, the vLLM connector, routing).  Beside them, this root package holds what every layer shares
(``errors``: the exception hierarchy, re-exported here; ``clock``), how Ray is attached to with its token
(``ray_auth``), the servers kvpool starts (``servers``), a whole local stack (``stack``) and the command line
(``cli``).
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
