"""Bad input through a live ``PoolNode`` actor (real Ray, etcd and segments): generated sequences of good and
malformed calls.  Each call succeeds or raises a :class:`~kvpool.errors.KvPoolError` with a message (no raw
``TypeError`` or ``KeyError`` from inside the actor); the actor keeps answering; and after every sequence the
node's audit finds nothing: its allocators agree with its chunks and rooms, and its chunks with the
placements etcd shows for it."""

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import KvPoolError
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.protocol import actor_name
from kvpool.pool.tiers.codecs import TensorFormat
from kvpool.servers.etcd import EmbeddedEtcd

EXAMPLES = 150
GOOD = chunk_keys(CacheIdentity(model="live-bad-input", kv_dtype="u8", layout="b", chunk_size=1), range(6))

bad_key = st.one_of(
    st.binary(max_size=40).filter(lambda b: len(b) != 32),
    st.text(max_size=5),
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
key = st.one_of(st.sampled_from(GOOD), st.sampled_from(GOOD), bad_key)
length = st.one_of(
    st.integers(1, 64 * 1024), st.sampled_from([0, -1, 2**40, 2**64]), st.floats(), st.text(max_size=3), st.none()
)
checksum = st.one_of(st.integers(0, 2**32), st.sampled_from([-1, 2**64]), st.text(max_size=3), st.none(), st.booleans())
fmt = st.one_of(st.none(), st.just(TensorFormat("float32", (16,))), st.just("float32"), st.integers())
tier = st.one_of(st.sampled_from([Tier.DRAM, Tier.NVME, Tier.REMOTE]), st.text(max_size=5))
#: a room opened earlier in the sequence (by index), else sent as it is
room_ref = st.one_of(st.integers(0, 3), st.integers(0, 3), st.sampled_from([-1, 10**9]), st.text(max_size=3), st.none())
in_room = st.one_of(st.sampled_from([0, 4096, 8192]), st.integers(-8192, 2**20), st.none(), st.text(max_size=2))
op = st.one_of(
    st.tuples(st.just("prepare_store"), length),
    st.tuples(
        st.just("complete_store"),
        room_ref,
        st.lists(st.tuples(key, in_room, length, checksum, fmt), max_size=3),
        st.booleans(),
        st.one_of(st.integers(0, 2 * MiB), st.sampled_from([-1, 2**40]), st.none(), st.text(max_size=2)),
    ),
    st.tuples(st.just("abort_store"), room_ref),
    st.tuples(st.just("prepare_load"), st.lists(key, min_size=1, max_size=3), st.none(), st.booleans()),
    st.tuples(st.just("remove"), st.lists(key, min_size=1, max_size=3)),
    st.tuples(st.just("touch"), st.lists(key, min_size=1, max_size=3)),
    st.tuples(st.just("move"), st.lists(key, min_size=1, max_size=3), tier),
)


@pytest.fixture(scope="module")
def node(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> Iterator[Any]:
    metadata = MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2)
    config = PoolConfig(
        metadata=metadata, namespace=f"live-{uuid.uuid4().hex[:8]}", dram_bytes=4 * MiB, nvme_bytes=4 * MiB
    )
    start_pool(config, ray_cluster[:1])
    yield ray.get_actor(actor_name(ray_cluster[0]), namespace=config.namespace)
    stop_pool(config)


def resolve(name: str, args: list[Any], rooms: list[Any]) -> list[Any]:
    """A room call's arguments with a room reference turned into that room's id, and offsets in it into offsets
    in the segment."""
    if name not in ("complete_store", "abort_store"):
        return args
    ref, *rest = args
    room = rooms[ref] if isinstance(ref, int) and 0 <= ref < len(rooms) else None
    if room is None:
        return args
    if name == "complete_store":
        items, *tail = rest
        at = [(k, room.offset + o if isinstance(o, int) else o, *more) for k, o, *more in items]
        return [room.id, at, *tail]
    return [room.id]


def run_calls(node: Any, calls: list[tuple[Any, ...]], seen: Counter[str]) -> None:
    """Make ``calls`` on the node: each succeeds or is refused with a typed error (counted in ``seen`` by outcome);
    then the node's audit finds nothing."""
    rooms: list[Any] = []
    try:
        for name, *given_args in calls:
            args = resolve(name, given_args, rooms)
            try:
                result = ray.get(getattr(node, name).remote(*args), timeout=60)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause
                assert isinstance(cause, KvPoolError), f"{name}{args!r:.200}: {type(cause).__name__}: {cause}"
                assert str(cause).strip(), f"{name}: {type(cause).__name__} without a message"
                seen[f"refused {type(cause).__name__}"] += 1
                continue
            seen["ok"] += 1
            if name == "prepare_store":
                rooms.append(result)
            elif name == "complete_store" and result.next_room is not None:
                rooms.append(result.next_room)
            if name == "prepare_load":  # pinned for a reader: let go
                ray.get(node.complete_load.remote([c.key for c in result.chunks if c is not None]))
    finally:  # rooms left open would fill DRAM until the reaper's turn
        ray.get([node.abort_store.remote(r.id) for r in rooms])
    assert ray.get(node.audit.remote()) == []


def test_live_node_refuses_bad_calls_and_stays_consistent(node: Any) -> None:
    """``EXAMPLES`` generated call sequences; over all of them, calls both succeeded and were refused, often."""
    seen: Counter[str] = Counter()

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(st.lists(op, min_size=1, max_size=6))
    def sequences(calls: list[tuple[Any, ...]]) -> None:
        run_calls(node, calls, seen)

    sequences()
    print(f"\nlive node calls: {dict(seen)}")
    assert seen["ok"] >= 100 and sum(n for k, n in seen.items() if k.startswith("refused")) >= 100
    assert ray.get(node.stats.remote())["node_id"]  # still answering
