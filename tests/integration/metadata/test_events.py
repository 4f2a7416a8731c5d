"""Chunk events from a real etcd: stored / moved / removed derived from the placement watch, a lease that runs out
delivers its removals, a consumer that resumes after its last revision misses nothing and repeats nothing, the
ZeroMQ stream decodes with vLLM's own classes, and ``kvpool events`` prints the same."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import zmq
from engine_needed import vllm_module

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.net import free_port
from kvpool.core.types import Placement, Tier
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.events import ChunkEvent, EventKind, EventStream, replay
from kvpool.metadata.identities import fingerprint
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.metadata.zmq_events import ZmqPublisher, vllm_batch

IDENTITY = CacheIdentity(model="events", kv_dtype="u8", layout="b", chunk_size=1)
KEYS, FP = chunk_keys(IDENTITY, range(6)), fingerprint(IDENTITY)
KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def placement(key: bytes, node: str, tier: Tier = Tier.DRAM) -> Placement:
    return Placement(key=key, node=node, tier=tier, offset=0, stored=4096, size=4096, checksum=1, identity=FP)


def collect(stream: EventStream) -> list[ChunkEvent]:
    return [e for _, batch in stream for e in batch]


def contents(store: PlacementStore, nodes: list[str]) -> dict[tuple[bytes, str], Tier | None]:
    return {(p.key, p.node): p.tier for n in nodes for p in store.held_by(n)}


def present(etcd: EtcdClient, ns: Namespace) -> int:
    """A revision past every write so far (the cluster's sync marker written now)."""
    return etcd.put(ns.sync_marker, b"x")


def test_events_follow_every_change_and_resume_after_a_revision(etcd: EtcdClient, namespace: Namespace) -> None:
    store = PlacementStore(etcd, namespace)
    a, b = etcd.grant_lease(30), etcd.grant_lease(2)
    store.publish([placement(KEYS[0], "n1")], a)
    start = present(etcd, namespace)
    first = collect(EventStream(etcd, namespace, until=start))
    assert [(e.kind, e.key, e.node, e.tier, e.revision) for e in first] == [
        (EventKind.STORED, KEYS[0], "n1", Tier.DRAM, start)  # the contents, at the snapshot's revision
    ]
    store.publish([placement(k, "n1") for k in KEYS[1:4]], a)
    store.publish([placement(KEYS[0], "n1", Tier.NVME)], a)  # demoted
    store.publish([placement(KEYS[0], "n1", Tier.NVME)], a)  # rewritten in the same tier: no event
    middle = present(etcd, namespace)
    store.delete([placement(KEYS[1], "n1")])
    store.publish([placement(k, "n2") for k in KEYS[4:]], b)  # on a lease that runs out: the node "died"
    deadline = time.monotonic() + 60
    while store.held_by("n2") and time.monotonic() < deadline:
        time.sleep(0.2)
    end = present(etcd, namespace)

    later = collect(EventStream(etcd, namespace, after=start, until=end))
    seen = [(e.kind, e.key, e.node, e.tier, e.was) for e in later]
    assert seen[:-2] == [
        *[(EventKind.STORED, k, "n1", Tier.DRAM, None) for k in KEYS[1:4]],
        (EventKind.MOVED, KEYS[0], "n1", Tier.NVME, Tier.DRAM),
        (EventKind.REMOVED, KEYS[1], "n1", Tier.DRAM, None),
        *[(EventKind.STORED, k, "n2", Tier.DRAM, None) for k in KEYS[4:]],
    ]
    assert sorted(seen[-2:]) == [(EventKind.REMOVED, k, "n2", Tier.DRAM, None) for k in sorted(KEYS[4:])]  # lease end
    assert all(e.revision > start and e.size == 4096 for e in later)
    assert {e.identity for e in [*first, *later]} == {FP}  # removals too, also those of the lease that ran out
    assert [e.revision for e in later] == sorted(e.revision for e in later)

    # a consumer that stopped at `middle` and resumed after it rebuilds the same contents as one that never stopped
    held: dict[tuple[bytes, str], Tier | None] = {}
    replay(first, held)
    replay([e for e in later if e.revision <= middle], held)
    replay(collect(EventStream(etcd, namespace, after=middle, until=end)), held)
    assert (
        held
        == contents(store, ["n1", "n2"])
        == {(KEYS[0], "n1"): Tier.NVME, (KEYS[2], "n1"): Tier.DRAM, (KEYS[3], "n1"): Tier.DRAM}
    )


def test_a_followed_stream_delivers_changes_as_they_happen_and_stops_when_cancelled(
    etcd: EtcdClient, namespace: Namespace
) -> None:
    store = PlacementStore(etcd, namespace)
    seen: list[ChunkEvent] = []
    stream = EventStream(etcd, namespace)
    arrived = threading.Event()

    def consume() -> None:
        for _, batch in stream:
            seen.extend(batch)
            if seen:
                arrived.set()

    thread = threading.Thread(target=consume)
    thread.start()
    store.publish([placement(KEYS[0], "n1")], etcd.grant_lease(30))
    assert arrived.wait(30)
    stream.cancel()
    thread.join(30)
    assert not thread.is_alive() and [(e.kind, e.key) for e in seen] == [(EventKind.STORED, KEYS[0])]


def test_zmq_stream_decodes_with_vllms_own_kv_event_classes(etcd: EtcdClient, namespace: Namespace) -> None:
    kv_events = vllm_module("vllm.distributed.kv_events")
    store = PlacementStore(etcd, namespace)
    store.publish([placement(KEYS[0], "n1")], etcd.grant_lease(30))
    start = present(etcd, namespace)
    batches = [vllm_batch(b, cleared=i == 0) for i, (_, b) in enumerate(EventStream(etcd, namespace, until=start))]
    store.publish([placement(KEYS[0], "n1", Tier.NVME), placement(KEYS[1], "n1")], etcd.grant_lease(30))
    store.delete([placement(KEYS[1], "n1")])
    end = present(etcd, namespace)
    batches += [vllm_batch(b) for _, b in EventStream(etcd, namespace, after=start, until=end) if b]

    pub_at, replay_at = (f"tcp://127.0.0.1:{free_port('127.0.0.1')}" for _ in range(2))
    publisher = ZmqPublisher(pub_at, replay_at)
    ctx = zmq.Context()
    sub, req = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        sub.connect(pub_at)
        sub.setsockopt(zmq.SUBSCRIBE, b"kvpool")
        time.sleep(0.5)  # a SUB socket joins asynchronously: what is sent before it joined is lost (not asserted)
        decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        for batch in batches:
            publisher.publish(batch)
        live: dict[int, bytes] = {}  # what the PUB socket delivered, by sequence number
        while len(batches) - 1 not in live and sub.poll(10_000):
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == b"kvpool"
            live[int.from_bytes(seq_bytes, "big")] = payload
        assert sorted(live) == list(range(min(live, default=len(batches)), len(batches)))  # only a head is lost
        # what a subscriber does about a gap: ask the replay socket from the first sequence number it lacks (0 here)
        req.connect(replay_at)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed: list[bytes] = []
        while True:
            assert req.poll(30_000), "the replay socket never answered"
            _, topic, seq_bytes, payload = req.recv_multipart()
            if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                break
            assert (topic, int.from_bytes(seq_bytes, "big")) == (b"kvpool", len(replayed))
            replayed.append(payload)
        assert len(replayed) == len(batches) and all(replayed[seq] == p for seq, p in live.items())
        events = [e for payload in replayed for e in decoder.decode(payload).events]
        assert [type(e).__name__ for e in events] == [
            "AllBlocksCleared",
            "BlockStored",
            "BlockRemoved",
            "BlockStored",
            "BlockStored",
            "BlockRemoved",
        ]
        assert [(e.block_hashes, e.medium, e.ownership) for e in events[1:]] == [
            ([KEYS[0]], "CPU", "n1"),
            ([KEYS[0]], "CPU", "n1"),
            ([KEYS[0]], "DISK", "n1"),  # the move: out, in
            ([KEYS[1]], "CPU", "n1"),
            ([KEYS[1]], "CPU", "n1"),
        ]
        stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
        assert [e.extra_keys for e in stored] == [[(FP,)]] * 3  # the cache identity, one entry per block hash
    finally:
        sub.close(linger=0)
        req.close(linger=0)
        ctx.term()
        publisher.close()


def test_kvpool_events_prints_the_contents_then_stops_at_the_present(
    etcd: EtcdClient, namespace: Namespace, metadata_config: MetadataConfig
) -> None:
    store = PlacementStore(etcd, namespace)
    store.publish([placement(k, "n1") for k in KEYS[:3]], etcd.grant_lease(30))
    args = ["events", "--etcd", metadata_config.endpoints[0], "--cluster", metadata_config.cluster, "--no-follow"]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([KVPOOL, *args, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(e["key"] for e in lines) == sorted(k.hex() for k in KEYS[:3])
    assert {(e["kind"], e["node"], e["tier"], e["identity"]) for e in lines} == {("stored", "n1", "dram", FP)}
    revision = lines[0]["revision"]
    store.delete([placement(KEYS[0], "n1")])
    done = subprocess.run(
        [KVPOOL, *args, "--after", str(revision)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "removed" in done.stdout and KEYS[0].hex()[:16] in done.stdout and KEYS[1].hex()[:16] not in done.stdout
    assert FP in done.stdout
    bad = subprocess.run([KVPOOL, *args, "--zmq-replay", "tcp://127.0.0.1:1"], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "--zmq-replay is set but --zmq is not" in bad.stdout + bad.stderr
