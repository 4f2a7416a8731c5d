"""The late-READ hole on a real pool (Ray + etcd + NIXL over TCP): a load from a holder that stalls past the READ's
deadline is a miss, the caller fills that memory itself (as an engine recomputes into the blocks a failed load was
filling), and when the holder goes on, nothing of the late READ lands there, while the pool serves the chunk again."""

import os
import signal
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.errors import ChunkNotFound, KvPoolError
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.scrape import scrape

CHUNK = 8 * MiB  #: big enough that a stalled holder's READ is still in flight at its deadline

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def pool(
    ray_cluster: list[str], metadata_config: MetadataConfig, monkeypatch: pytest.MonkeyPatch
) -> Iterator[PoolConfig]:
    """A pool on every Ray node; this process's transport speaks TCP only (over shared memory a READ is the reader's
    own copy, which a stopped holder cannot stall: not late, so nothing to close)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    config = PoolConfig(metadata=metadata_config, namespace=f"late-{uuid.uuid4().hex[:8]}", dram_bytes=32 * MiB)
    start_pool(config, ray_cluster)
    yield config
    stop_pool(config)


def test_a_late_read_never_lands_in_memory_the_caller_reused(pool: PoolConfig, ray_cluster: list[str]) -> None:
    [key] = chunk_keys(CacheIdentity(model="late-read", kv_dtype="u8", layout="b", chunk_size=1), range(1))
    data = np.random.default_rng(7).integers(0, 256, CHUNK, dtype=np.uint8)
    holder = ray_cluster[2]  # not this process's node: its chunks come by READ
    with PoolClient(pool) as client:
        client.put_batch([(key, data.tobytes())], nodes=[holder])
        blocks = np.zeros(CHUNK, dtype=np.uint8)  # the engine's KV blocks
        client.register_buffer(blocks)
        [record] = [n for n in client.cache.nodes() if n.node_id == holder]
        os.kill(record.pid, signal.SIGSTOP)
        try:
            with pytest.raises(KvPoolError):  # the READ times out, the pinned call finds the holder stopped: a miss
                client.get_into(key, blocks)
            assert client.peers.set_aside == 1
            assert client.transfer_faults["late"] == 1  # kept by the client too: an engine counts them itself
            blocks[:] = 0xA5  # the recompute
        finally:
            os.kill(record.pid, signal.SIGCONT)
        again = np.zeros(CHUNK, dtype=np.uint8)
        client.register_buffer(again)
        for _ in range(600):  # the holder serves again, through the new transport; were the old one progressed, here
            try:
                assert client.get_into(key, again) == CHUNK
                break
            except ChunkNotFound:  # the pinned call the stop held up ends first (up to its timeout): misses till then
                time.sleep(0.2)
        assert np.array_equal(again, data)
        assert np.all(blocks == 0xA5)  # nothing of the late READ landed
        [here] = [n for n in client.cache.nodes() if n.node_id == client.node_id]
    for _ in range(300):  # the fault is in this node's metrics (the client's last report, sent as it closed)
        if scrape(here.metrics).get("kvpool_transfer_faults_total{late}", 0) >= 1:
            break
        time.sleep(0.2)
    assert scrape(here.metrics).get("kvpool_transfer_faults_total{late}", 0) >= 1
