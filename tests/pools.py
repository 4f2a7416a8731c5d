"""Pools the whole session shares, one per shape, each lent to a test emptied (``tests/conftest.py``'s
``pool_shelf``).

Starting a pool costs seconds (an actor per node, its segments, NIXL agent and etcd records); emptying one costs a
remove call per node.  So tests of one shape (the pool tests' small pool, the engines' and SGLang's larger one) share
a pool, and each test gets it back as new: every chunk removed, every node alive.  A test that broke it (killed a
node, stopped the pool, left chunks that do not go) gets it replaced.  What a test cannot get back from an emptied
pool is the nodes' cumulative counters (``kvpool_puts_total``, ``bytes_via_ray`` and the like): tests read those as
differences.
"""

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator

from kvpool.errors import KvPoolError
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig, Watermarks
from kvpool.pool.node import start_pool, stop_pool

log = logging.getLogger(__name__)

EMPTY_TIMEOUT_S = 60.0

#: a pool shape: the etcd endpoint → a config of that shape under a cluster and namespace no other pool uses
Shape = Callable[[str], PoolConfig]


def _names(etcd: str, lease_ttl_s: int) -> tuple[MetadataConfig, str]:
    metadata = MetadataConfig(endpoints=(etcd,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=lease_ttl_s)
    return metadata, f"kvpool-{uuid.uuid4().hex[:8]}"


def small(etcd: str) -> PoolConfig:
    """The pool tests': 4 MiB DRAM and 8 MiB NVMe a node, eviction from 80 % down to 50 %, leases of 2 s."""
    metadata, namespace = _names(etcd, lease_ttl_s=2)
    return PoolConfig(
        metadata=metadata,
        dram_bytes=4 * MiB,
        nvme_bytes=8 * MiB,
        watermarks=Watermarks(high=0.8, low=0.5),
        namespace=namespace,
    )


def engines(etcd: str) -> PoolConfig:
    """The engines' (vLLM's and SGLang's): 64 MiB DRAM and NVMe a node; leases of 30 s, so a killed holder's
    placements stay listed long enough for a test to ask for them."""
    metadata, namespace = _names(etcd, lease_ttl_s=30)
    return PoolConfig(metadata=metadata, dram_bytes=64 * MiB, nvme_bytes=64 * MiB, namespace=namespace)


class PoolShelf:
    """The session's shared pools on the Ray nodes ``node_ids``, started when first lent."""

    def __init__(self, etcd: str, node_ids: list[str]) -> None:
        self.etcd = etcd
        self.node_ids = node_ids
        self._pools: dict[Shape, PoolConfig] = {}

    @contextlib.contextmanager
    def lend(self, shape: Shape) -> Iterator[PoolConfig]:
        """The pool of ``shape``, running on every node; emptied when given back (or replaced, if it cannot be)."""
        if shape not in self._pools:
            config = shape(self.etcd)
            start_pool(config)
            self._pools[shape] = config
        config = self._pools[shape]
        yield config
        if not self._emptied(config):
            stop_pool(config)
            del self._pools[shape]

    def _emptied(self, config: PoolConfig) -> bool:
        """Remove every chunk of the pool; False if a node is gone or a chunk stays (the pool is not reused then)."""
        try:
            with PoolClient(config) as client:
                client.cache.sync()
                nodes = client.stats()["nodes"]  # every node asked: a killed one answers with an error
                if sorted(nodes) != sorted(self.node_ids) or any("error" in n for n in nodes.values()):
                    return False
                client.remove_batch([key for key, _ in client.cache.chunks()])
                return client.cache.wait_until(lambda c: c.chunk_count() == 0, timeout_s=EMPTY_TIMEOUT_S)
        except KvPoolError as exc:
            log.warning("pool %s not reused: %s", config.namespace, exc)
            return False

    def close(self) -> None:
        for config in self._pools.values():
            stop_pool(config)
        self._pools.clear()
