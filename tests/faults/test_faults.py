"""Faults on a real pool (Ray + etcd + NIXL): a cache may miss, it never serves wrong bytes, and it keeps
working when a node dies, bytes rot or every chunk is pinned.  Each test prints its figures."""

import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray_nodes import extra_ray_node

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import ChunkNotFound, CorruptChunk, KvPoolError, PoolFull
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig, Watermarks
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.protocol import actor_name

CHUNK = 64 * 1024


def blob(i: int, size: int = CHUNK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def keys_of(tag: str, n: int) -> list[bytes]:
    return chunk_keys(CacheIdentity(model=f"faults-{tag}", kv_dtype="u8", layout="b", chunk_size=1), range(n))


MakePool = Callable[..., PoolConfig]


@pytest.fixture
def make_pool(ray_cluster: list[str], metadata_config: MetadataConfig) -> Iterator[MakePool]:
    """Start a pool on the given Ray nodes (a fresh namespace each); all of them stop after the test."""
    started: list[PoolConfig] = []

    def make(nodes: list[str], **kw: Any) -> PoolConfig:
        config = PoolConfig(metadata=metadata_config, namespace=f"faults-{uuid.uuid4().hex[:8]}", **kw)
        start_pool(config, nodes)
        started.append(config)
        return config

    yield make
    for config in started:
        stop_pool(config)


def test_bytes_flipped_in_dram_and_nvme_are_always_caught(
    make_pool: MakePool, ray_cluster: list[str], tmp_path: Path
) -> None:
    """One byte flipped in every chunk, half in DRAM (shared memory) and half in NVMe (the segment file):
    every read is a miss (CorruptChunk), never the wrong bytes, and every corrupt placement is dropped."""
    pool = make_pool(ray_cluster[:1], dram_bytes=8 * MiB, nvme_bytes=8 * MiB, nvme_dir=str(tmp_path))
    keys = keys_of("flip", 32)
    with PoolClient(pool) as client:
        client.put_batch([(k, blob(i)) for i, k in enumerate(keys)])
        client.move(keys[16:], Tier.NVME)
        assert {p.tier for k in keys[16:] for p in client.cache.replicas(k)} == {Tier.NVME}
        [nvme_file] = tmp_path.glob("*.nvme")  # beside it: the segment's journal and lock (warm restart)
        rng = random.Random(7)
        bound = client.local.current()
        assert bound is not None
        for key in keys:
            [p] = client.cache.replicas(key)
            at = p.offset + rng.randrange(p.stored)
            if p.tier is Tier.DRAM:
                old = bound.segment.view(at, 1)[0]
                bound.segment.write(at, bytes([old ^ 0xFF]))
            else:
                with open(nvme_file, "r+b") as f:  # behind the node's back; O_DIRECT reads see it after fsync
                    f.seek(at)
                    old = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([old ^ 0xFF]))
                    f.flush()
                    os.fsync(f.fileno())
        caught = 0
        for key in keys:
            with pytest.raises(CorruptChunk):
                client.get(key)
            caught += 1
            assert not client.exists(key)  # placement dropped
        node = client.stats()["nodes"][client.node_id]
        print(f"\nbyte flips: {len(keys)} injected (16 DRAM, 16 NVMe), {caught} caught, 0 served")
        assert node["corrupt"] == len(keys)
        client.put(keys[0], blob(0))  # the node keeps working
        assert client.get(keys[0]) == blob(0)


def test_a_full_pool_with_every_chunk_pinned_refuses_puts_and_keeps_serving_reads(
    make_pool: MakePool, ray_cluster: list[str]
) -> None:
    """DRAM (and NVMe) full of chunks a reader has pinned: a put is PoolFull with nothing published, the
    pinned chunks still read, and once released the put goes through (LRU chunks make room)."""
    # no NVMe and no watermark migration: full means full
    pool = make_pool(ray_cluster[:1], dram_bytes=2 * MiB, nvme_bytes=-1, watermarks=Watermarks(high=1.0, low=0.95))
    keys = keys_of("pinned", 40)
    with PoolClient(pool) as client:
        client.put_batch([(k, blob(i)) for i, k in enumerate(keys[:30])])  # 1.9 MiB of 2
        node = ray.get_actor(actor_name(client.node_id), namespace=pool.namespace)
        held = [k for k in keys[:30] if client.exists(k)]
        ray.get(node.prepare_load.remote(held))  # a reader pins every chunk
        try:
            with pytest.raises(PoolFull):
                client.put_batch([(k, blob(i)) for i, k in enumerate(keys[30:], start=30)])
            assert not any(client.exists(k) for k in keys[30:])  # no partial placement
            assert client.get_batch(held[:5]) == [blob(keys.index(k)) for k in held[:5]]
        finally:
            ray.get(node.complete_load.remote(held))
        client.put_batch([(k, blob(i)) for i, k in enumerate(keys[30:], start=30)])
        assert client.get(keys[-1]) == blob(len(keys) - 1)
        ray.get(node.stats.remote())  # still answering


def test_a_pool_node_killed_during_traffic_loses_no_acknowledged_chunk(
    make_pool: MakePool, ray_cluster: list[str]
) -> None:
    """Puts (replicas=2) and verified gets run while one PoolNode actor is killed: no get ever returns other
    bytes, every acknowledged chunk stays readable, the dead node's placements vanish within lease TTL
    + 1 s, and the survivors accept new puts."""
    pool = make_pool(ray_cluster, dram_bytes=16 * MiB, nvme_bytes=16 * MiB)
    victim = ray_cluster[2]
    _traffic_through_a_death(
        pool,
        victim,
        "PoolNode actor killed",
        lambda: ray.kill(ray.get_actor(actor_name(victim), namespace=pool.namespace)),
    )


@pytest.mark.parametrize("probed", [True, False], ids=["a-put-failed-meanwhile", "no-call-meanwhile"])
def test_a_pool_node_started_again_on_its_ray_node_is_reached_again(
    make_pool: MakePool, ray_cluster: list[str], probed: bool
) -> None:
    """A PoolNode actor killed and started again on the same Ray node is a new actor: a client looks the node up
    again once its record names the new process and puts to it and reads from it as before — whether a put failed
    there meanwhile (on the dead actor, or on its transfer while the actor was still dying, which left the handle
    looking alive) or no call of the client went there at all (until the record was checked, the first put after
    the restart failed on the old handle)."""
    pool = make_pool(ray_cluster, dram_bytes=16 * MiB, nvme_bytes=16 * MiB)
    victim = ray_cluster[2]
    keys = keys_of(f"again-{probed}", 2)
    with PoolClient(pool) as client:
        client.put_batch([(keys[0], blob(0))], nodes=[victim])
        [old] = [n.pid for n in client.cache.nodes() if n.node_id == victim]
        ray.kill(ray.get_actor(actor_name(victim), namespace=pool.namespace))
        if probed:
            with pytest.raises(KvPoolError):  # the dead actor (or, once its record expired, no live node there)
                client.put_batch([(keys[1], blob(1))], nodes=[victim])
        start_pool(pool, [victim])
        deadline = time.monotonic() + 120  # a bound on a hang, not a timing claim
        while not any(n.node_id == victim and n.pid != old for n in client.cache.nodes()):
            assert time.monotonic() < deadline, "the node started again never published its record"
            time.sleep(0.2)
        client.put_batch([(keys[1], blob(1))], nodes=[victim])
        assert client.get(keys[1]) == blob(1)


def test_a_room_held_on_a_peer_started_again_is_never_written_into_the_new_node(
    make_pool: MakePool, ray_cluster: list[str]
) -> None:
    """A client holds a room on a peer (the one its last put there opened) when the peer is killed and started again,
    and no call of the client has found the old actor dead yet; another client puts chunks to the new node, over the
    offsets of that room.  The first client's next put fails (a KvPoolError) or lands whole, the one after lands, and
    every chunk the new node acknowledged reads back with its own bytes.  (The room was reused: the WRITE reached the
    new node's agent, over its chunks, which then failed their checksum.)"""
    # rooms stay fresh however long the restart takes, so the room held is the one the next put would reuse
    pool = make_pool(ray_cluster, dram_bytes=16 * MiB, nvme_bytes=16 * MiB, reservation_ttl_s=3600)
    victim = ray_cluster[2]
    keys = keys_of("stale-room", 10)
    with PoolClient(pool) as writer:
        writer.put_batch([(keys[0], blob(0))], nodes=[victim])  # its reply opened the writer's next room there
        [old] = [n.pid for n in writer.cache.nodes() if n.node_id == victim]
        _kill_node(pool, victim)  # through a handle of the test's own: the writer's is not found dead
        start_pool(pool, [victim])
        _wait_for_record(writer, victim, lambda pid: pid != old)
        with PoolClient(pool) as other:
            theirs = {k: blob(100 + i) for i, k in enumerate(keys[2:])}
            other.put_batch(list(theirs.items()), nodes=[victim])  # from the new DRAM's start: over the room held
            try:
                writer.put_batch([(keys[1], blob(1))], nodes=[victim])
            except KvPoolError:  # the old actor (found dead now) or its room: the next put looks the node up again
                writer.put_batch([(keys[1], blob(1))], nodes=[victim])
            assert writer.get(keys[1]) == blob(1)
            read = {k: _read_or_miss(other, k) for k in theirs}
            lost = [i for i, k in enumerate(theirs) if read[k] != theirs[k]]
            assert not lost, f"acknowledged chunks of the new node lost (overwritten through an old room): {lost}"


def test_a_client_whose_own_pool_node_was_started_again_saves_there_and_reads_from_there(
    make_pool: MakePool, ray_cluster: list[str]
) -> None:
    """The PoolNode on the client's own Ray node killed and started again (a new actor, a new DRAM segment file): on
    its first call after the node's record names the new process, the client binds the new node, so a put lands in its
    DRAM through the new mapping and a get reads it back.  A chunk put before the restart reads intact or is a miss,
    never other bytes.  (The client kept the dead handle and the old mapping, saving nothing on its node and reading
    nothing from it, until it was made anew.)"""
    pool = make_pool(ray_cluster, dram_bytes=16 * MiB, nvme_bytes=16 * MiB)
    keys = keys_of("local-again", 3)
    with PoolClient(pool) as client:
        here = client.node_id  # the driver's Ray node, which holds a pool node
        client.put(keys[0], blob(0))
        before = client.local.current()
        assert before is not None and client.cache.replicas(keys[0])[0].node == here
        _kill_node(pool, here)
        with pytest.raises(KvPoolError):  # the dead actor (or, once its record expired, no live node here)
            client.put_batch([(keys[1], blob(1))], nodes=[here])
        assert _read_or_miss(client, keys[0]) in (blob(0), None)
        start_pool(pool, [here])
        _wait_for_record(client, here, lambda pid: pid != before.info.pid)
        client.put(keys[2], blob(2))
        [p] = client.cache.replicas(keys[2])
        assert p.node == here and p.tier is Tier.DRAM
        after = client.local.current()
        assert after is not None and after.info.pid != before.info.pid and after.info.dram_path != before.info.dram_path
        with after.segment.view(p.offset, p.stored) as held:  # in the new node's segment, as this client maps it
            assert bytes(held) == blob(2)
        assert client.get(keys[2]) == blob(2)
        assert _read_or_miss(client, keys[0]) in (blob(0), None)
        assert not before.segment.closed  # another thread may still copy out of it: mapped until the client closes
    assert before.segment.closed and after.segment.closed


def test_a_pool_node_started_on_the_clients_ray_node_after_the_client_is_bound(
    make_pool: MakePool, ray_cluster: list[str]
) -> None:
    """A client made where no pool node runs sends every chunk to peers; once a pool node starts on its Ray node and
    publishes its record, the client's next put lands there, through its mapped segment."""
    pool = make_pool(ray_cluster[1:], dram_bytes=16 * MiB, nvme_bytes=16 * MiB)
    [key] = keys_of("local-later", 1)
    with PoolClient(pool) as client:
        here = client.node_id
        assert here == ray_cluster[0] and client.info is None
        start_pool(pool, [here])
        _wait_for_record(client, here, lambda pid: True)
        client.put_batch([(key, blob(3))], nodes=[here])
        [p] = client.cache.replicas(key)
        bound = client.local.current()
        assert p.node == here and bound is not None and client.info == bound.info
        with bound.segment.view(p.offset, p.stored) as held:
            assert bytes(held) == blob(3)
        assert client.get(key) == blob(3)


def _kill_node(pool: PoolConfig, node_id: str) -> None:
    """Kill the node's PoolNode actor and wait until a call finds it dead."""
    actor = ray.get_actor(actor_name(node_id), namespace=pool.namespace)
    ray.kill(actor)
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing claim
    while True:
        try:
            ray.get(actor.info.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed PoolNode actor kept answering"


def _wait_for_record(client: PoolClient, node_id: str, new: Callable[[int], bool]) -> None:
    """Wait until the client's watch cache shows a record of ``node_id`` whose process is ``new``."""
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing claim
    while not any(n.node_id == node_id and new(n.pid) for n in client.cache.nodes()):
        assert time.monotonic() < deadline, "the node started never published its record"
        time.sleep(0.2)


def _read_or_miss(client: PoolClient, key: bytes) -> bytes | None:
    try:
        return client.get(key)
    except ChunkNotFound:
        return None


def test_a_whole_ray_node_killed_during_traffic_loses_no_acknowledged_chunk(
    make_pool: MakePool, ray_cluster: list[str]
) -> None:
    """The same with a whole Ray node gone at once (raylet, object store, workers, the PoolNode: a power
    cut): every process started by that node's ``ray start`` is SIGKILLed."""
    with extra_ray_node("127.0.0.9") as (node_id, kill):
        pool = make_pool([*ray_cluster[:2], node_id], dram_bytes=16 * MiB, nvme_bytes=16 * MiB)
        _traffic_through_a_death(pool, node_id, "whole Ray node killed", kill)


def _traffic_through_a_death(pool: PoolConfig, victim: str, what: str, kill: Callable[[], None]) -> None:
    """Puts (replicas=2) and verified gets from the head node while ``kill`` runs 1 s in; prints the figures
    and checks: no mismatch, no miss, no acknowledged chunk lost, the victim's placements gone within
    lease TTL + 1 s, and new puts land on the survivors."""
    ttl = pool.metadata.lease_ttl_s
    keys = keys_of(f"kill-{uuid.uuid4().hex[:6]}", 300)
    acked: dict[bytes, int] = {}
    counts = {"puts": 0, "put_failures": 0, "gets": 0, "get_misses": 0, "mismatches": 0}
    with PoolClient(pool) as client:
        killed_at: list[float] = []
        gone_after: list[float] = []

        def kill_then_watch() -> None:
            """Kill, then time how long the metadata keeps naming the victim (polled apart from the traffic,
            whose calls to the dead node may block for a while)."""
            kill()
            killed_at.append(time.monotonic())
            while time.monotonic() - killed_at[0] < 4 * ttl + 10:
                if not _still_listed(client, victim, dict(acked)):
                    gone_after.append(time.monotonic() - killed_at[0])
                    return
                time.sleep(0.02)

        timer = threading.Timer(1.0, kill_then_watch)
        timer.start()
        rng = random.Random(3)
        deadline = time.monotonic() + 1.0 + ttl + 6
        i = 0
        while time.monotonic() < deadline and i < len(keys):
            try:
                client.put(keys[i], blob(i), replicas=2)
                acked[keys[i]] = i
                counts["puts"] += 1
            except KvPoolError:
                counts["put_failures"] += 1  # not acknowledged: allowed while the dead node is still listed
            i += 1
            for key in rng.sample(list(acked), min(3, len(acked))):
                counts["gets"] += 1
                try:
                    if client.get(key) != blob(acked[key]):
                        counts["mismatches"] += 1
                except ChunkNotFound:
                    counts["get_misses"] += 1
        timer.join()
        lost = [k for k in acked if client.get(k) != blob(acked[k])]
        print(
            f"\n{what} during traffic: {counts}; acknowledged {len(acked)}, lost {len(lost)}; "
            f"placements gone {round(gone_after[0], 2) if gone_after else None} s after the kill"
        )
        assert counts["mismatches"] == 0 and counts["get_misses"] == 0 and not lost
        assert gone_after and gone_after[0] <= ttl + 1
        fresh = keys_of("after", 4)
        client.put_batch([(k, blob(100 + j)) for j, k in enumerate(fresh)], replicas=2)
        assert all(victim not in {p.node for p in client.cache.replicas(k)} for k in fresh)


def _still_listed(client: PoolClient, node: str, keys: dict[bytes, int]) -> bool:
    """Whether the metadata still names ``node``: as a live node, or as the holder of any of ``keys``."""
    if node in {n.node_id for n in client.cache.nodes()}:
        return True
    return any(p.node == node for k in keys for p in client.cache.replicas(k))
