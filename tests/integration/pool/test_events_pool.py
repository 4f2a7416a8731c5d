"""Chunk events from a real pool: puts, a demotion and a remove show up as they happen, and when a PoolNode is
killed every chunk it held is delivered as removed; a consumer that rebuilt the contents from events alone, with a
disconnect in the middle, matches the placements the pool's watch cache holds.  Every event names the cache identity
the chunks were put under."""

import threading
import time

import numpy as np
import pytest
import ray

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.metadata.events import ChunkEvent, EventKind, EventStream, replay
from kvpool.metadata.identities import fingerprint
from kvpool.metadata.namespace import Namespace
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig
from kvpool.pool.protocol import actor_name

IDENTITY = CacheIdentity(model="events-pool", kv_dtype="u8", layout="b", chunk_size=1)
KEYS = chunk_keys(IDENTITY, range(8))


def test_events_of_a_pool_with_a_node_killed(pool: PoolConfig, client: PoolClient, ray_cluster: list[str]) -> None:
    ns = Namespace(pool.metadata.cluster)
    here, victim = ray_cluster[0], ray_cluster[2]
    data = np.arange(64 * 1024, dtype=np.uint8)
    fp = client.register_identity(IDENTITY)
    assert fp == fingerprint(IDENTITY)
    with pytest.raises(ConfigError, match="fingerprint"):  # checked before anything is written
        client.put_batch([(k, data) for k in KEYS[:4]], nodes=[here], identity=IDENTITY)  # type: ignore[arg-type]
    client.put_batch([(k, data) for k in KEYS[:4]], nodes=[here], identity=fp)
    start = client.cache.sync()
    assert {p.identity for k in KEYS[:4] for p in client.cache.replicas(k)} == {fp}

    held: dict[tuple[bytes, str], Tier | None] = {}
    contents = [e for _, b in EventStream(client.etcd, ns, until=start) for e in b]
    assert {e.identity for e in contents if e.key in KEYS} == {fp}
    replay(contents, held)
    seen: list[ChunkEvent] = []
    reached = [start]  #: the revision the stream has reached (the sync marker's batch has no chunk event in it)
    stream = EventStream(client.etcd, ns, after=start)
    follower = threading.Thread(target=lambda: [(seen.extend(b), reached.append(r)) for r, b in stream])
    follower.start()
    try:
        client.put_batch([(k, data) for k in KEYS[4:]], nodes=[victim], identity=fp)
        client.move(KEYS[:1], Tier.NVME)
        client.remove_batch(KEYS[1:2])
        middle = client.cache.sync()
        ray.kill(ray.get_actor(actor_name(victim), namespace=pool.namespace))  # its lease runs out, its keys go
        assert client.cache.wait_until(lambda c: all(not c.replicas(k) for k in KEYS[4:]), timeout_s=60)
        end = client.cache.sync()
        deadline = time.monotonic() + 60
        while reached[-1] < end and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stream.cancel()
        follower.join(30)

    later = [e for e in seen if e.revision <= end]
    removed_with_node = {e.key for e in later if e.kind is EventKind.REMOVED and e.node == victim}
    assert removed_with_node == set(KEYS[4:])  # every chunk of the killed node, delivered
    assert [(e.kind, e.tier, e.was) for e in later if e.key == KEYS[0]] == [(EventKind.MOVED, Tier.NVME, Tier.DRAM)]
    assert [e.kind for e in later if e.key == KEYS[1]] == [EventKind.REMOVED]
    assert {e.identity for e in later} == {fp}  # stored, moved, removed, and removed with the node

    # disconnected at `middle`: resumes after it from etcd and ends with what the pool holds
    replay([e for e in later if e.revision <= middle], held)
    replay([e for _, b in EventStream(client.etcd, ns, after=middle, until=end) for e in b], held)
    assert held == {(k, p.node): p.tier for k, ps in client.cache.chunks() for p in ps}
    assert set(held) == {(k, here) for k in (KEYS[0], KEYS[2], KEYS[3])}
