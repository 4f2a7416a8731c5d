"""A client's view of a chunk's replicas: which there are (the watch cache, caught up with etcd once before a key
counts as missing), in the one replica order (:func:`~kvpool.core.types.nearest_first`), and reading any of them in
that order, dropping those that fail their checksum, until one is intact."""

import contextlib
import logging
from collections.abc import Callable, Sequence

from kvpool.core.keys import check_key
from kvpool.core.types import Placement, Tier, nearest_first
from kvpool.errors import (
    ChunkNotFound,
    ConfigError,
    CorruptChunk,
    MetadataUnavailable,
    NodeUnreachable,
    RemoteUnavailable,
)
from kvpool.metadata.cache import MetadataCache
from kvpool.pool.chunks import short
from kvpool.pool.client.reads import NodeReads
from kvpool.pool.client.remote_reads import RemoteReads
from kvpool.pool.protocol import NodeHandles

log = logging.getLogger(__name__)


class Replicas:
    """The replicas seen by a client on Ray node ``node_id``; ``caught_up(revision)`` waits until its watch cache
    shows an etcd revision (after a corrupt replica is dropped)."""

    def __init__(
        self,
        node_id: str,
        cache: MetadataCache,
        nodes: NodeHandles,
        reads: NodeReads,
        remote: RemoteReads,
        wait_s: float,
        caught_up: Callable[[int], None],
    ) -> None:
        self.node_id, self.cache, self.nodes, self.reads, self.remote = node_id, cache, nodes, reads, remote
        self._wait_s, self._caught_up = wait_s, caught_up

    def of(self, keys: Sequence[bytes]) -> list[list[Placement]]:
        """The replicas of each key, nearest first; ``ChunkNotFound`` for a key the pool does not hold.  A key this
        watch cache does not show may have been put by another client a moment ago: the cache is caught up with
        etcd once (a read-your-writes barrier, one etcd write) before it counts as missing."""
        found = [self.cache.replicas(check_key(k)) for k in keys]
        if not all(found):
            with contextlib.suppress(MetadataUnavailable):  # etcd away: what the cache shows is all there is
                self.cache.sync(timeout_s=self._wait_s)
            found = [f or self.cache.replicas(k) for f, k in zip(found, keys, strict=True)]
        for f, k in zip(found, keys, strict=True):
            if not f:
                raise ChunkNotFound(f"chunk {short(k)} is not in the pool; recompute it")
        return [sorted(f, key=nearest_first(self.node_id)) for f in found]

    def source(self, p: Placement) -> str:
        """Where a read comes from, as the metrics name it: this node, a peer, or the remote tier."""
        return "remote_tier" if p.tier is Tier.REMOTE else "local" if p.node == self.node_id else "peer"

    def read_any(self, key: bytes, dest: memoryview) -> int:
        """Read ``key`` from its replicas in turn, nearest first, dropping corrupt ones, until one is intact."""
        corrupt: list[Placement] = []
        for replica in self.of([key])[0]:
            if replica.size != dest.nbytes:
                raise ConfigError(
                    f"buffer holds {dest.nbytes} bytes, chunk {short(key)} is {replica.size}: pass a buffer of its size"
                )
            try:
                if replica.tier is Tier.REMOTE:
                    [intact] = self.remote.read([replica], [dest])
                else:
                    [intact] = self.reads.pinned(replica.node, [key], [[dest]])
            except (NodeUnreachable, ChunkNotFound):
                continue  # that node is gone, or the chunk left it
            if intact is None:
                continue  # the placement was stale, or the holder could not be reached
            if intact:
                return dest.nbytes
            log.warning("chunk %s on %s fails its checksum; dropping that replica", short(key), replica.node[:12])
            corrupt.append(replica)
            self.drop_corrupt(replica)
        if corrupt:
            raise CorruptChunk(f"every replica of chunk {short(key)} was corrupt and has been dropped; recompute it")
        raise ChunkNotFound(f"chunk {short(key)}: no replica could be read; recompute it")

    def drop_corrupt(self, replica: Placement) -> None:
        if replica.tier is Tier.REMOTE:
            with contextlib.suppress(RemoteUnavailable):
                self.remote.drop([replica])
            return
        with contextlib.suppress(NodeUnreachable):
            self._caught_up(self.nodes[replica.node].remove([replica.key], corrupt=True).revision)
