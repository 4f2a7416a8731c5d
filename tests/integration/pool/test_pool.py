"""The pool on a real multi-node Ray cluster and a real etcd: PoolNode actors, PoolClient, faults."""

import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import ChunkBusy, ChunkNotFound, ConfigError, CorruptChunk, PoolFull
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.protocol import actor_name

IDENT = CacheIdentity(model="test", kv_dtype="uint8", layout="bytes", chunk_size=4)


def blob(i: int, n: int = 256 * 1024) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@ray.remote(num_cpus=0)
class RemoteClient:
    """A PoolClient living on another Ray node: the cross-node side of the tests."""

    def __init__(self, config: PoolConfig) -> None:
        self.client = PoolClient(config)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.client, method)(*args)

    def node_id(self) -> str:
        return self.client.node_id


def remote_client(config: PoolConfig, node_id: str) -> Any:
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return RemoteClient.options(scheduling_strategy=strategy).remote(config)


def test_one_pool_node_per_ray_node(client: PoolClient, ray_cluster: list[str]) -> None:
    nodes = client.cache.nodes()
    assert sorted(n.node_id for n in nodes) == sorted(ray_cluster)
    for n in nodes:
        assert n.capacity(Tier.DRAM) == 4 * MiB and n.capacity(Tier.NVME) == 8 * MiB


def test_put_and_get_on_the_same_node(client: PoolClient) -> None:
    keys = chunk_keys(IDENT, range(40))
    client.put(keys[0], blob(0))
    assert client.get(keys[0]) == blob(0)
    [p] = client.cache.replicas(keys[0])
    assert p.node == client.node_id and p.tier is Tier.DRAM
    # numpy arrays and CPU tensors go in without a copy; get_into fills a caller's buffer
    arr = np.frombuffer(blob(1), dtype=np.float16).copy()
    client.put(keys[1], arr)
    out = np.empty_like(arr)
    assert client.get_into(keys[1], out) == arr.nbytes and out.tobytes() == arr.tobytes()  # NaNs compare unequal
    t = torch.arange(1024, dtype=torch.bfloat16)
    client.put(keys[2], t)
    back = torch.empty_like(t)
    client.get_into(keys[2], back)
    assert torch.equal(back, t)
    assert client.exists_batch(keys[:4]) == [True, True, True, False]
    assert client.lookup_prefix(keys) == 3


def test_put_on_one_node_get_on_another(pool: PoolConfig, client: PoolClient, ray_cluster: list[str]) -> None:
    keys = chunk_keys(IDENT, range(20))
    via_ray = {node: s["bytes_via_ray"] for node, s in client.stats()["nodes"].items()}  # earlier tests' counts
    other = remote_client(pool, ray_cluster[1])
    ray.get(other.call.remote("put_batch", [(k, blob(i)) for i, k in enumerate(keys[:3])]))
    client.cache.sync()  # another process's put: this client's watch sees it once caught up with etcd
    assert {p.node for k in keys[:3] for p in client.cache.replicas(k)} == {ray_cluster[1]}
    assert client.get_batch(keys[:3]) == [blob(i) for i in range(3)]
    kv = np.zeros(3 * len(blob(0)), dtype=np.uint8)  # a caller's long-lived buffer: READs land in it directly
    client.register_buffer(kv)
    parts = [kv[i * len(blob(0)) : (i + 1) * len(blob(0))] for i in range(3)]
    client.get_into_batch(keys[:3], parts)
    assert [p.tobytes() for p in parts] == [blob(i) for i in range(3)]
    # a chunk spread over regions (its bytes in order): a READ per region when registered, else one checked copy
    half = len(blob(0)) // 2
    kv[:] = 0
    client.get_into_batch(keys[:1], [[kv[2 * half : 3 * half], kv[:half]]])
    assert kv[2 * half : 3 * half].tobytes() + kv[:half].tobytes() == blob(0) and not kv[half : 2 * half].any()
    client.unregister_buffer(kv)
    loose = [np.zeros(half, dtype=np.uint8), np.zeros(len(blob(1)) - half, dtype=np.uint8)]
    client.get_into_batch(keys[1:2], [loose])
    assert b"".join(p.tobytes() for p in loose) == blob(1)
    client.put(keys[3], blob(3))
    assert ray.get(other.call.remote("get", keys[3])) == blob(3)
    client.put_batch([(keys[4], blob(4))], nodes=[ray_cluster[1]])  # a cross-node put: NIXL WRITE
    assert ray.get(other.call.remote("get", keys[4])) == blob(4)
    nodes = client.stats()["nodes"]
    assert all(nodes[n]["bytes_via_ray"] == via_ray[n] for n in (ray_cluster[1], client.node_id))


def test_replicas_live_on_distinct_nodes_and_survive_a_node(
    pool: PoolConfig, client: PoolClient, ray_cluster: list[str]
) -> None:
    keys = chunk_keys(IDENT, range(12))
    client.put_batch([(k, blob(i)) for i, k in enumerate(keys)], replicas=2)
    holders = {p.node for p in client.cache.replicas(keys[0])}
    assert len(holders) == 2 and client.node_id in holders
    victim = next(iter(holders - {client.node_id}))
    ray.kill(ray.get_actor(actor_name(victim), namespace=pool.namespace))  # no cleanup hook runs
    ttl = pool.metadata.lease_ttl_s
    assert client.cache.wait_until(lambda c: victim not in {n.node_id for n in c.nodes()}, timeout_s=ttl + 2)
    assert all(victim not in {p.node for p in client.cache.replicas(k)} for k in keys)
    assert client.get_batch(keys) == [blob(i) for i in range(3)]  # from the surviving replica
    assert len(client.cache.nodes()) == 2
    with pytest.raises(PoolFull, match="replicas=3"):
        client.put(chunk_keys(IDENT, range(16))[3], blob(9), replicas=3)


def test_eviction_to_nvme_keeps_data_intact(client: PoolClient) -> None:
    keys = chunk_keys(IDENT, range(4 * 30))
    client.put_batch([(k, blob(i)) for i, k in enumerate(keys[:24])])  # 6 MiB into 4 MiB of DRAM + 8 of NVMe
    tiers = [p.tier for k in keys[:24] for p in client.cache.replicas(k)]
    assert Tier.NVME in tiers and Tier.DRAM in tiers
    assert client.get_batch(keys[:24]) == [blob(i) for i in range(24)]

    def below_high() -> dict[str, Any] | None:  # the node's demoter thread gets DRAM under its high watermark
        stats: dict[str, Any] = client.stats()["nodes"][client.node_id]
        return stats if stats["tiers"]["dram"]["used"] <= 0.8 * 4 * MiB else None

    stats = wait_for(below_high)
    assert stats["migrations"] > 0
    assert 0 <= stats["tiers"]["nvme"]["fragmentation"] < 1 and stats["tiers"]["nvme"]["chunks"] > 0


def wait_for(probe: Any, timeout_s: float = 60.0) -> Any:
    """``probe()``'s first truthy answer, asking every 50 ms (a generous bound: not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not (answer := probe()):
        assert time.monotonic() < deadline, "the pool did not get there in time"
        time.sleep(0.05)
    return answer


def test_chunks_left_on_nvme_are_read_from_the_file_here_and_as_call_results_by_peers(
    pool: PoolConfig, ray_cluster: list[str]
) -> None:
    config = msgspec.structs.replace(pool, promote_on_hit=False, namespace=pool.namespace + "-np")
    start_pool(config)
    try:
        with PoolClient(config) as client:
            keys = chunk_keys(IDENT, range(4 * 50))[:6]
            client.put_batch([(k, blob(i, 100_000)) for i, k in enumerate(keys)])
            client.move(keys, Tier.NVME)
            assert client.get_batch(keys) == [blob(i, 100_000) for i in range(6)]  # straight from the NVMe file
            outs = [bytearray(100_000), bytearray(100_000)]
            assert client.get_into_batch(keys[:2], outs) == [100_000, 100_000] and outs[1] == blob(1, 100_000)
            other = remote_client(config, ray_cluster[1])
            assert ray.get(other.call.remote("get_batch", keys)) == [blob(i, 100_000) for i in range(6)]
            nodes = client.stats()["nodes"][client.node_id]
            assert nodes["promotions"] == 0 and nodes["bytes_via_ray"] == 6 * 100_000  # the peer's reads only
            assert ray.get(ray.get_actor(actor_name(client.node_id), namespace=config.namespace).audit.remote()) == []
    finally:
        stop_pool(config)


def test_corrupt_bytes_are_a_miss_never_wrong_data(client: PoolClient) -> None:
    key = chunk_keys(IDENT, range(4))[0]
    client.put(key, blob(5))
    [p] = client.cache.replicas(key)
    bound = client.local.current()
    assert bound is not None
    bound.segment.write(p.offset, b"\xff" * 16)  # flip bytes behind the pool's back
    with pytest.raises(CorruptChunk):
        client.get(key)
    assert not client.exists(key)  # the corrupt replica was dropped
    with pytest.raises(ChunkNotFound):
        client.get(key)


def test_bad_input(client: PoolClient) -> None:
    key = chunk_keys(IDENT, range(4))[0]
    with pytest.raises(ChunkNotFound):
        client.get(key)
    with pytest.raises(ConfigError, match="`key` must be a 32-byte chunk key"):
        client.put(b"short", b"x")
    with pytest.raises(PoolFull, match="larger than"):
        client.put(key, bytes(5 * MiB))
    assert not client.exists(key)  # nothing half-written
    client.put(key, blob(1))
    with pytest.raises(ConfigError, match="buffer holds"):
        client.get_into(key, bytearray(10))
    with pytest.raises(ConfigError, match="non-contiguous"):
        client.put(key, np.zeros((4, 4))[:, 1])
    assert client.remove(key) and not client.exists(key)
    assert not client.remove(key)


def test_corrupt_bytes_on_another_node_are_caught_after_the_transfer(
    pool: PoolConfig, client: PoolClient, ray_cluster: list[str]
) -> None:
    """A chunk read one-sided from another node is checked like any other: corrupt → a miss, dropped."""
    from kvpool.pool.segment import DramSegment

    keys = chunk_keys(IDENT, range(8))
    holder = ray_cluster[2]
    client.put_batch([(keys[0], blob(7)), (keys[1], blob(8))], nodes=[holder])
    assert client.get_batch(keys[:2]) == [blob(7), blob(8)]  # read over NIXL, intact
    info = ray.get(ray.get_actor(actor_name(holder), namespace=pool.namespace).info.remote())
    [p] = client.cache.replicas(keys[0])
    with DramSegment.attach(info.dram_path, info.dram_capacity) as seg:  # same machine: reach its memory
        seg.write(p.offset + 1000, b"\x00\x01\x02")
    with pytest.raises(CorruptChunk):
        client.get(keys[0])
    assert not client.exists(keys[0]) and client.get(keys[1]) == blob(8)


def _release_after_a_refusal(node: Any, keys: list[bytes]) -> threading.Thread:
    """Hold a reader's release of ``keys`` back until ``node`` has put off one more move or remove."""
    refused = ray.get(node.stats.remote())["busy"]

    def release() -> None:
        while ray.get(node.stats.remote())["busy"] == refused:
            time.sleep(0.01)
        ray.get(node.complete_load.remote(keys))

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def test_a_move_or_remove_waits_for_a_read_in_flight(
    pool: PoolConfig, client: PoolClient, ray_cluster: list[str]
) -> None:
    """Issue 14: a read pins its chunks and lets go without waiting; a move or remove that reaches the holder
    before the release (another client's, ordered only through the caller) waits for it instead of failing.
    The release is held back until the node has refused once, so the race is taken every run."""
    keys = chunk_keys(IDENT, range(40))
    holder = ray_cluster[1]
    node = ray.get_actor(actor_name(holder), namespace=pool.namespace)
    client.put_batch([(k, blob(i)) for i, k in enumerate(keys[:3])], nodes=[holder])
    # another reader's pins, as get_into_batch takes them
    assert None not in ray.get(node.prepare_load.remote(keys[:2])).chunks
    releasing = _release_after_a_refusal(node, keys[:2])
    client.move(keys[:3], Tier.NVME)
    releasing.join()
    assert {p.tier for k in keys[:3] for p in client.cache.replicas(k)} == {Tier.NVME}
    assert client.get_batch(keys[:3]) == [blob(i) for i in range(3)]  # promoted back, pins released
    assert None not in ray.get(node.prepare_load.remote(keys[:1])).chunks
    releasing = _release_after_a_refusal(node, keys[:1])
    assert client.remove_batch(keys[:3]) == 3
    releasing.join()
    assert not any(client.exists_batch(keys[:3])) and ray.get(node.audit.remote()) == []
    for _ in range(5):  # this client's own releases reach the node before its next call there
        client.put_batch([(keys[5], blob(5))], nodes=[holder])
        assert client.get(keys[5]) == blob(5)
        client.move([keys[5]], Tier.NVME)
        assert client.remove(keys[5])


def test_a_chunk_pinned_past_busy_wait_is_chunk_busy_and_the_rest_is_done(
    pool: PoolConfig, ray_cluster: list[str]
) -> None:
    """A read that never ends (its reader hung) keeps its chunk: after ``busy_wait_s`` the caller gets
    ChunkBusy naming it, every other chunk of the batch is moved, and the node stays consistent."""
    keys = chunk_keys(IDENT, range(40))
    holder = ray_cluster[2]
    node = ray.get_actor(actor_name(holder), namespace=pool.namespace)
    with PoolClient(msgspec.structs.replace(pool, busy_wait_s=0.3)) as client:
        client.put_batch([(k, blob(i)) for i, k in enumerate(keys[:4])], nodes=[holder])
        ray.get(node.prepare_load.remote(keys[:1]))
        with pytest.raises(ChunkBusy, match=r"1 chunks .* still being read after 0.3 s \(busy_wait_s\)"):
            client.move(keys[:4], Tier.NVME)
        tiers = [p.tier for k in keys[:4] for p in client.cache.replicas(k)]
        assert tiers == [Tier.DRAM, Tier.NVME, Tier.NVME, Tier.NVME]
        assert ray.get(node.audit.remote()) == []
        ray.get(node.complete_load.remote(keys[:1]))
        assert client.remove_batch(keys[:4]) == 4 and ray.get(node.audit.remote()) == []


def test_prefetch_brings_the_held_prefix_into_one_nodes_dram(
    pool: PoolConfig, client: PoolClient, ray_cluster: list[str]
) -> None:
    """Into another node: its own NVMe copies promoted there, this node's copied over, the rest left alone."""
    keys = chunk_keys(IDENT, range(4 * 40))[:7]
    other = ray_cluster[1]
    client.put_batch([(k, blob(i)) for i, k in enumerate(keys[:2])], nodes=[other])
    client.move(keys[:2], Tier.NVME)
    client.put_batch([(k, blob(i + 2)) for i, k in enumerate(keys[2:4])], nodes=[client.node_id])
    client.put_batch([(keys[4], blob(4))], nodes=[other])
    client.put_batch([(keys[6], blob(6))])  # after the gap at keys[5]: a reader never gets there
    done = client.prefetch(keys, other)
    assert (done.already, done.promoted, done.copied, done.not_held) == (1, 2, 2, 2)
    assert done.nbytes == 4 * len(blob(0))
    assert all(Tier.DRAM in {p.tier for p in client.cache.replicas(k) if p.node == other} for k in keys[:5])
    assert not [p for p in client.cache.replicas(keys[6]) if p.node == other]
    assert ray.get(remote_client(pool, other).call.remote("get_batch", keys[:5])) == [blob(i) for i in range(5)]
    again = client.prefetch(keys[:5], other)
    assert (again.already, again.promoted, again.copied, again.nbytes) == (5, 0, 0, 0)
    with pytest.raises(ConfigError, match="keys"):
        client.prefetch([b"short"], other)


def test_the_engine_fronts_prefetcher_runs_on_its_own_thread_and_never_raises(
    pool: PoolConfig, client: PoolClient, ray_cluster: list[str]
) -> None:
    from kvpool.prefill_decode.vllm.front import Prefetcher

    keys = chunk_keys(IDENT, range(4 * 50))[:3]
    client.put_batch([(k, blob(i)) for i, k in enumerate(keys)], nodes=[client.node_id])
    prefetcher = Prefetcher(pool)
    try:
        assert prefetcher.submit(keys, ray_cluster[1]).result(60).copied == 3
        assert prefetcher.submit(keys, "no-such-node").result(60) is None  # logged and counted, not raised
        assert prefetcher.counts == {"asked": 2, "promoted": 0, "copied": 3, "failed": 1}
    finally:
        prefetcher.close()
    client.cache.sync()  # another client's puts: seen once this watch caught up with etcd
    assert all(ray_cluster[1] in {p.node for p in client.cache.replicas(k)} for k in keys)


def test_connect_peers_reaches_every_other_node_before_any_transfer(client: PoolClient, ray_cluster: list[str]) -> None:
    """What an engine does at start: every peer connected and wired up (a READ each), the staging buffer registered."""
    assert client.registrations == 0
    assert client.connect_peers() == len(ray_cluster) - 1
    assert client.registrations == 1
