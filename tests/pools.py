"""Pools the session shares, one per shape while tests of that shape run, each lent to a test emptied (``tests/conftest.py``'s
``pool_shelf``).

Starting a pool costs seconds (an actor per node, its segments, NIXL agent and etcd records); emptying one costs a
remove call per node.  So tests of one shape (the pool tests' small pool, the engines' and SGLang's larger one) share
a pool, and each test gets it back as new: every chunk removed, every node alive.  A test that broke it (killed a
node, stopped the pool, left chunks that do not go) gets it replaced.  What a test cannot get back from an emptied
pool is the nodes' cumulative counters (``kvpool_puts_total``, ``bytes_via_ray`` and the like): tests read those as
differences.
"""

import contextlib
import functools
import logging
import uuid
from collections import Counter
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


def names(etcd: str, lease_ttl_s: int) -> tuple[MetadataConfig, str]:
    """A shape's metadata config (on ``etcd``, a cluster no other pool uses) and a Ray namespace of its own."""
    metadata = MetadataConfig(endpoints=(etcd,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=lease_ttl_s)
    return metadata, f"kvpool-{uuid.uuid4().hex[:8]}"


def small(etcd: str) -> PoolConfig:
    """The pool tests': 4 MiB DRAM and 8 MiB NVMe a node, eviction from 80 % down to 50 %, leases of 2 s."""
    metadata, namespace = names(etcd, lease_ttl_s=2)
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
    metadata, namespace = names(etcd, lease_ttl_s=30)
    return PoolConfig(metadata=metadata, dram_bytes=64 * MiB, nvme_bytes=64 * MiB, namespace=namespace)


@functools.cache
def both_tiers(mib: int) -> Shape:
    """``mib`` MiB of DRAM and of NVMe a node, leases of 2 s (the prefill/decode tests')."""

    def shape(etcd: str) -> PoolConfig:
        metadata, namespace = names(etcd, lease_ttl_s=2)
        return PoolConfig(metadata=metadata, dram_bytes=mib * MiB, nvme_bytes=mib * MiB, namespace=namespace)

    return shape


class PoolShelf:
    """The session's shared pools on the Ray nodes ``node_ids``, each started when first lent.  An idle pool node
    costs ~1 % of a core (its Ray worker's threads), so lending a pool of a new shape stops those no test holds."""

    def __init__(self, etcd: str, node_ids: list[str]) -> None:
        self.etcd = etcd
        self.node_ids = node_ids
        self._pools: dict[Shape, PoolConfig] = {}
        self._lent: Counter[Shape] = Counter()  #: how many tests or modules hold each

    @contextlib.contextmanager
    def lend(self, shape: Shape) -> Iterator[PoolConfig]:
        """The pool of ``shape``, running on every node; emptied when given back (or replaced, if it cannot be)."""
        if shape not in self._pools:
            self._stop(idle_only=True)
            self._pools[shape] = shape(self.etcd)
            start_pool(self._pools[shape])
        config = self._pools[shape]
        self._lent[shape] += 1
        try:
            yield config
        finally:
            self._lent[shape] -= 1
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

    def _stop(self, idle_only: bool) -> None:
        for shape in [s for s in self._pools if not (idle_only and self._lent[s])]:
            stop_pool(self._pools.pop(shape))

    def close(self) -> None:
        self._stop(idle_only=False)
