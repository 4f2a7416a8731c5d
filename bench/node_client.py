"""One ``PoolClient`` per node, as a Ray actor pinned there: the benchmarks time puts and gets where they run."""

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.bench.limits import median_seconds
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig

BATCH = 8  #: values per get (and put) call unless told otherwise: a serving engine's few reused KV buffers


class Elapsed(NamedTuple):
    """What one timed pass took on the actor's node."""

    wall_s: float
    cpu_s: float  #: CPU time of the actor's process (all its threads)


def get_all(client: PoolClient, keys: Sequence[bytes], bufs: Sequence[np.ndarray]) -> float:
    """Read every key, in batches of ``len(bufs)`` into the same buffers; returns the seconds taken."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), len(bufs)):
        batch = keys[i : i + len(bufs)]
        client.get_into_batch(batch, bufs[: len(batch)])
    return time.perf_counter() - t0


class NodeClient:
    """A ``PoolClient`` on one node (wrapped as a Ray actor pinned there by :func:`node_clients`)."""

    def __init__(self, config: PoolConfig) -> None:
        self.client = PoolClient(config)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.bufs: list[np.ndarray] = []

    def ucx_tls(self) -> str:
        """The UCX transports this actor's process was started with (Ray workers inherit the driver's)."""
        return os.environ.get("UCX_TLS", "")

    def put(self, keys: list[bytes], size: int, holder: str, batch: int = BATCH) -> Elapsed:
        """Put ``keys`` (``size`` random bytes each) into ``holder``'s DRAM, ``batch`` values a call."""
        data = np.random.default_rng(len(keys)).integers(0, 256, size, dtype=np.uint8)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(keys), batch):
            self.client.put_batch([(k, data) for k in keys[i : i + batch]], nodes=[holder])
        return Elapsed(time.perf_counter() - t0, time.process_time() - c0)

    def get_once(self, keys: list[bytes], size: int, batch: int = BATCH) -> Elapsed:
        """One pass reading every key into registered buffers, ``batch`` at a time, reused (as a serving engine
        reuses its KV buffers: READs land in them directly).  Registering them is not timed."""
        bufs = self._buffers(size, min(batch, len(keys)))
        t0, c0 = time.perf_counter(), time.process_time()
        get_all(self.client, keys, bufs)
        return Elapsed(time.perf_counter() - t0, time.process_time() - c0)

    def get(self, keys: list[bytes], size: int, tier: str = "", repeat: int = 3) -> float:
        """Median seconds of ``repeat`` passes of :meth:`get_once`.  With ``tier`` the chunks are moved there
        before each pass."""

        def once() -> float:
            if tier:
                self.client.move(keys, Tier(tier))
            return self.get_once(keys, size).wall_s

        return median_seconds(once, repeat)

    def latencies(self, keys: list[bytes], size: int, seconds: float) -> list[float]:
        """Seconds of each single-key ``get_into`` call made in ``seconds``, cycling through ``keys``, into one
        registered buffer."""
        [buf] = self._buffers(size, 1)
        out: list[float] = []
        end = time.perf_counter() + seconds
        while (t0 := time.perf_counter()) < end:
            self.client.get_into(keys[len(out) % len(keys)], buf)
            out.append(time.perf_counter() - t0)
        return out

    def put_for(self, tag: str, size: int, holder: str, seconds: float, batch: int = BATCH) -> int:
        """Put fresh ``size``-byte chunks into ``holder`` for ``seconds``, ``batch`` a call; how many."""
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        ident = CacheIdentity(model=f"put-for-{tag}", kv_dtype="uint8", layout="bytes", chunk_size=1)
        end, n = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            keys = chunk_keys(ident, range(n, n + batch))
            self.client.put_batch([(k, data) for k in keys], nodes=[holder])
            n += batch
        return n

    def _buffers(self, size: int, count: int) -> list[np.ndarray]:
        """``count`` registered buffers of ``size`` bytes, kept for the next pass of the same size."""
        if not self.bufs or self.bufs[0].nbytes != size or len(self.bufs) < count:
            for b in self.bufs:
                self.client.unregister_buffer(b)
            self.bufs = [np.empty(size, dtype=np.uint8) for _ in range(max(count, BATCH))]
            for b in self.bufs:
                self.client.register_buffer(b)
        return self.bufs[:count]

    def remove(self, keys: list[bytes]) -> int:
        return self.client.remove_batch(keys)

    def close(self) -> None:
        self.client.close()


def node_clients(config: PoolConfig, node_ids: Sequence[str]) -> list[Any]:
    """One :class:`NodeClient` actor pinned to each of ``node_ids``, ready."""
    actor: Any = ray.remote(num_cpus=0, max_restarts=0)(NodeClient)
    clients = [
        actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(config)
        for nid in node_ids
    ]
    ray.get([c.__ray_ready__.remote() for c in clients])
    return clients


def close_clients(clients: Sequence[Any], timeout_s: float = 30) -> None:
    """Close each client's ``PoolClient`` (what fails to close is let go) and end its actor."""
    for c in clients:
        with contextlib.suppress(Exception):
            ray.get(c.close.remote(), timeout=timeout_s)
        ray.kill(c)
