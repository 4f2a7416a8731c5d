"""One exception hierarchy for the whole project.

Every error a caller can act on is a :class:`KvPoolError`; library errors (gRPC, etcd, NIXL, boto3) are
translated into these where the library is wrapped, so callers never catch a third-party type.  Each
message says what happened *and* what to do about it.
"""


class KvPoolError(Exception):
    """Base class of every error kvpool raises on purpose."""


class ConfigError(KvPoolError, ValueError):
    """A configuration value or an argument (a chunk key, token ids, a size) is malformed or out of range;
    the message names the field."""


class MetadataUnavailable(KvPoolError):
    """etcd could not be reached (after a bounded retry) or refused the request."""


class MalformedRecord(KvPoolError):
    """A value stored in etcd is not a record kvpool understands (not msgpack, wrong schema)."""


class ChunkNotFound(KvPoolError, KeyError):
    """No replica of the chunk is known to the pool: treat it as a cache miss and recompute."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence.
        return str(self.args[0]) if self.args else "chunk not found"


class PoolFull(KvPoolError):
    """The pool cannot hold the data, even after eviction."""


class ChunkBusy(KvPoolError):
    """A chunk is pinned by a read in flight (this client's or another's), so it cannot be moved or removed
    now.  Reads are short: ``PoolClient`` waits up to ``PoolConfig.busy_wait_s`` for them before raising this;
    retry later, or find the reader that holds it (a reader that died keeps its pins until its node restarts)."""


class CorruptChunk(ChunkNotFound):
    """Stored bytes did not match their checksum and no intact replica was left; the corrupt replicas have
    been dropped.  A ``ChunkNotFound``: callers treat it as a miss and recompute."""


class TransferError(KvPoolError):
    """A transfer between two nodes failed or timed out (peer dead, unreachable, or refused); for a read
    the pool treats the chunk as a miss on that replica."""


class TransferInFlight(TransferError):
    """A READ passed its deadline and may still land in its destination later (NIXL could not prove it stopped):
    that memory holds nothing valid until the transfer ends, so the caller reports its chunks as misses."""


class NodeUnreachable(TransferError):
    """A pool node is dead, stopped, or did not answer in time.  A read moves on to another replica (and is a miss
    if none is left); a put to it fails: put again, and the pool picks live nodes (``kvpool status`` lists them)."""


class WorkerUnavailable(KvPoolError):
    """A prefill or decode worker of a service died or cannot be reached; restart the service."""


class UnencodableTensor(KvPoolError, ValueError):
    """A codec was handed a tensor it cannot encode: not a torch tensor, a dtype other than float16,
    bfloat16 or float32, no dimensions, or NaN/inf for a quantizing codec; store it raw or fix the producer."""


class UndecodableChunk(ChunkNotFound):
    """Bytes are not a chunk the codec can decode (truncated, bad header, unknown codec, corrupt compressed
    stream, sizes that disagree with the header).  A ``ChunkNotFound``: callers treat it as a miss and recompute."""


class UndecryptableChunk(ChunkNotFound):
    """Sealed stored bytes could not be opened here: their key id is not in this process's keyring, the key under
    that id is not the one that sealed them, or the bytes were altered or belong to another chunk.  A miss: recompute
    (and check that this process's key file is the pool's)."""


class RemoteUnavailable(KvPoolError):
    """The remote tier could not be used: the endpoint is down or unreachable, the credentials were refused
    (403), or the bucket is missing.  For a read the chunk is a miss in that tier; nothing in the other tiers is
    affected."""


class TenantRefused(KvPoolError):
    """A request named a tenant the tenants file does not have, a shared namespace its tenant may not use, or an API
    key no tenant holds (the HTTP front answers 401/403).  Add the tenant or the namespace to the tenants file, or
    send a key it lists."""


class RayAuthError(KvPoolError):
    """This process cannot authenticate to a pool's Ray cluster: no token was found, the cluster refused the one given,
    or authentication is off here while the cluster requires it.  The message says where to put the token
    (kvpool/ray_auth.py finds it where Ray does)."""


class SetupError(KvPoolError):
    """The machine lacks something this process needs, though the configuration asks for it correctly: a binary
    or a wheel is not installed, a library cannot be imported, a file or directory the configuration names does
    not exist or cannot be read or created, a port is taken, or a device or filesystem feature is absent.  The
    message names the thing: install it, free it or fix its permissions, or point the configuration elsewhere."""
