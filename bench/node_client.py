"""One ``PoolClient`` per node, as a Ray actor pinned there: the benchmarks time puts and gets where they run."""

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.bench.limits import median_seconds
from kvpool.metadata.records import Tier
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig


class NodeClient:
    """A ``PoolClient`` on one node (wrapped as a Ray actor pinned there by :func:`node_clients`)."""

    def __init__(self, config: PoolConfig) -> None:
        self.client = PoolClient(config)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.bufs: list[np.ndarray] = []

    def put(self, keys: list[bytes], size: int, holder: str) -> float:
        """Seconds to put ``keys`` (``size`` bytes each) into ``holder``'s DRAM."""
        data = np.random.default_rng(len(keys)).integers(0, 256, size, dtype=np.uint8)
        t0 = time.perf_counter()
        for i in range(0, len(keys), 8):
            self.client.put_batch([(k, data) for k in keys[i : i + 8]], nodes=[holder])
        return time.perf_counter() - t0

    def get(self, keys: list[bytes], size: int, tier: str = "", repeat: int = 3) -> float:
        """Median seconds to read every key into registered buffers (8 at a time, reused, as a serving
        engine reuses its KV buffers).  With ``tier`` the chunks are moved there before each pass."""
        if not self.bufs or self.bufs[0].nbytes != size:
            self._buffers(size)

        def once() -> float:
            if tier:
                self.client.move(keys, Tier(tier))
            t0 = time.perf_counter()
            for i in range(0, len(keys), len(self.bufs)):
                batch = keys[i : i + len(self.bufs)]
                self.client.get_into_batch(batch, self.bufs[: len(batch)])
            return time.perf_counter() - t0

        return median_seconds(once, repeat)

    def _buffers(self, size: int) -> None:
        for b in self.bufs:
            self.client.unregister_buffer(b)
        self.bufs = [np.empty(size, dtype=np.uint8) for _ in range(8)]
        for b in self.bufs:
            self.client.register_buffer(b)

    def remove(self, keys: list[bytes]) -> int:
        return self.client.remove_batch(keys)

    def close(self) -> None:
        self.client.close()


def node_clients(config: PoolConfig, node_ids: Sequence[str]) -> list[Any]:
    actor: Any = ray.remote(num_cpus=0, max_restarts=0)(NodeClient)
    clients = [
        actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(config)
        for nid in node_ids
    ]
    ray.get([c.__ray_ready__.remote() for c in clients])
    return clients
