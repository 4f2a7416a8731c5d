"""Writes through rooms on a real pool: the client keeps the room the node opened for its next batch, and a room
the node no longer has (reclaimed, or the node's earlier life) costs one more round, never a lost or wrong chunk."""

import numpy as np
import ray

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.pool.client import PoolClient

KEYS = chunk_keys(CacheIdentity(model="rooms", kv_dtype="u8", layout="b", chunk_size=1), range(6))


def data(i: int) -> np.ndarray:
    return np.full(64 * 1024, i, dtype=np.uint8)


def test_a_room_the_node_no_longer_has_is_written_again(client: PoolClient) -> None:
    client.put_batch([(k, data(i)) for i, k in enumerate(KEYS[:2])])
    node, room, _ = client.rooms._held[client.node_id]  # the room opened for the next batch
    assert room.length >= 2 * 64 * 1024
    ray.get(node.actor.abort_store.remote(room.id))  # waited for; as the reaper does with a room left idle past its TTL
    client.put_batch([(k, data(i)) for i, k in enumerate(KEYS[2:4], start=2)])
    assert [client.get(k) for k in KEYS[:4]] == [data(i).tobytes() for i in range(4)]
    assert client.rooms._held[client.node_id][1].id != room.id
    client.put_batch([(KEYS[0], data(0)), (KEYS[4], data(4))])  # a key held already keeps its first copy
    assert client.get(KEYS[4]) == data(4).tobytes() and node.audit() == []
