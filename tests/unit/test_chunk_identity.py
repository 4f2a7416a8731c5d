"""The cache identity a chunk was put under, carried from the writer to the pool's events: what a put accepts, the
store and the NVMe journal that keep it, the placement record (schema 3) that carries it, and the events, text, JSON
and vLLM-shaped, that report it.  Real segments and stores; no Ray, no etcd (tests/integration/pool/
test_events_pool.py follows it through a real pool)."""

import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvpool.cli.events import _line
from kvpool.core.keys import CacheIdentity
from kvpool.core.types import Placement, Tier
from kvpool.errors import ConfigError, MalformedRecord
from kvpool.metadata.events import ChunkEvent, EventKind
from kvpool.metadata.identities import fingerprint
from kvpool.metadata.records import decode_placement, encode_placement
from kvpool.metadata.zmq_events import BlockRemoved, BlockStored, vllm_batch
from kvpool.pool.chunks import Origin, checksum, shared_origin
from kvpool.pool.node import journal as journal_module
from kvpool.pool.node.collector import StoreCollector
from kvpool.pool.node.journal import NvmeJournal, segment_name, take_back
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment

IDENTITY = CacheIdentity(model="identity-test", kv_dtype="u8", layout="bytes")
FP = fingerprint(IDENTITY)
KEY = bytes(range(32))
BLOCK = 64 * 1024


@pytest.fixture
def dram() -> Iterator[DramSegment]:
    segment = DramSegment.create(8 * BLOCK, "/dev/shm")
    yield segment
    segment.close()


@pytest.mark.parametrize(
    "bad", [FP.upper(), FP[:-1], FP + "0", FP + "\n", 7, None, FP.encode(), IDENTITY], ids=lambda v: f"{v!r:.20}"
)
def test_an_identity_that_is_not_a_fingerprint_is_refused_with_what_to_pass(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"fingerprint \(16 lower-case hex digits: what PoolClient.register_identity"):
        Origin("", bad)  # type: ignore[arg-type]


def test_an_origin_is_checked_again_when_it_arrives_unpickled_and_its_strings_are_shared() -> None:
    assert Origin().identity == "" and Origin("acme", FP).identity == FP
    with pytest.raises(ConfigError, match="tenant"):
        Origin("not a name", FP)
    tampered = pickle.dumps(Origin("acme", FP)).replace(FP.encode(), FP.upper().encode())  # a Ray argument's bytes
    with pytest.raises(ConfigError, match="fingerprint"):
        pickle.loads(tampered)
    one, two = (shared_origin(pickle.loads(pickle.dumps(Origin("acme", FP)))) for _ in range(2))
    assert one == two and one.identity is two.identity and one.tenant is two.tenant  # one string per origin


def test_placement_record_carries_the_identity_and_a_schema_2_record_is_not_read() -> None:
    p = Placement(KEY, "node-1", Tier.NVME, offset=4096, stored=1024, size=4096, checksum=9, codec="fp8", identity=FP)
    assert decode_placement(KEY, "node-1", encode_placement(p)) == p
    anonymous = replace(p, identity="")
    assert decode_placement(KEY, "node-1", encode_placement(anonymous)) == anonymous
    again = [decode_placement(KEY, "node-1", encode_placement(p)) for _ in range(2)]
    assert again[0].identity is again[1].identity and again[0].codec is again[1].codec  # interned: a cache shares them

    fields = msgspec.msgpack.decode(encode_placement(p))
    assert fields["v"] == 3 and fields["identity"] == FP
    old = {k: v for k, v in fields.items() if k != "identity"} | {"v": 2}
    with pytest.raises(MalformedRecord, match="schema version 2, this kvpool reads 3"):
        decode_placement(KEY, "node-1", msgspec.msgpack.encode(old))
    for bad in (FP.upper(), FP[:8], FP + "\n", 5):
        with pytest.raises(MalformedRecord, match="identity"):
            decode_placement(KEY, "node-1", msgspec.msgpack.encode(fields | {"identity": bad}))


def test_the_store_and_the_nvme_journal_keep_the_origin_across_a_warm_restart(
    tmp_path: Path, dram: DramSegment
) -> None:
    data = memoryview(np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
    name = segment_name("identity", "127.0.0.9")
    with ThreadPoolExecutor(2) as io:
        nvme, journal, named = NvmeJournal.open(str(tmp_path), name, 8 * BLOCK)
        store = ChunkStore(dram, nvme)
        take_back(store, journal, nvme, named, io)
        store.put(KEY, data, checksum(data), origin=Origin("acme", FP))
        store.put(bytes(32), data, checksum(data))
        assert [c.origin for c in store.chunks()] == [Origin("acme", FP), Origin()]
        for key in (KEY, bytes(32)):
            store.move(key, Tier.NVME)
        journal.record(store.take_changes())
        journal.close()
        nvme.close()

        nvme, journal, named = NvmeJournal.open(str(tmp_path), name, 8 * BLOCK)
        again = ChunkStore(dram, nvme)
        recovery = take_back(again, journal, nvme, named, io)
        assert {c.key: c.origin for c in recovery.adopted} == {KEY: Origin("acme", FP), bytes(32): Origin()}
        assert again.held(KEY) is not None and again.held(KEY).tenant == "acme"  # type: ignore[union-attr]
        assert again.counters["recovered"] == 2 and again.audit() == []
        journal.close()
        nvme.close()
    # a put record written before records carried the identity is read with none
    old = journal_module._chunk(["put", KEY, 0, BLOCK, BLOCK, 7, "raw", None, "acme"])
    assert old.origin == Origin("acme") and old.tier is Tier.NVME
    with pytest.raises(ConfigError):
        journal_module._chunk(["put", KEY, 0, BLOCK, BLOCK, 7, "raw", None, "acme", "not-a-fingerprint"])


def test_events_report_the_identity_in_text_json_and_vllm_shape() -> None:
    stored = ChunkEvent(EventKind.STORED, 5, KEY, "node-1", Tier.DRAM, 4096, identity=FP)
    moved = ChunkEvent(EventKind.MOVED, 6, KEY, "node-1", Tier.NVME, 4096, was=Tier.DRAM, identity=FP)
    removed = ChunkEvent(EventKind.REMOVED, 7, KEY, "node-1", Tier.NVME, 4096, identity=FP)
    unknown = ChunkEvent(EventKind.REMOVED, 8, bytes(32), "node-1", None)
    assert [e.as_json()["identity"] for e in (stored, moved, removed, unknown)] == [FP, FP, FP, ""]
    assert FP in _line(stored) and FP in _line(removed) and "  -  " in _line(unknown)
    batch = vllm_batch([stored, moved, removed, unknown])
    assert batch.events == [
        BlockStored([KEY], None, [], 0, None, "CPU", None, [(FP,)], ownership="node-1"),
        BlockRemoved([KEY], "CPU", ownership="node-1"),
        BlockStored([KEY], None, [], 0, None, "DISK", None, [(FP,)], ownership="node-1"),
        BlockRemoved([KEY], "DISK", ownership="node-1"),
        BlockRemoved([bytes(32)], None, ownership="node-1"),
    ]
    anonymous = vllm_batch([replace(stored, identity="")]).events[0]
    assert isinstance(anonymous, BlockStored) and anonymous.extra_keys is None  # omitted on the wire


def test_node_metrics_export_drops_past_the_tombstone_budget(dram: DramSegment) -> None:
    collector = StoreCollector("node-1", ChunkStore(dram), lambda: {"etcd_errors": 2, "tombstones_unrecorded": 17})
    samples = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert samples["kvpool_tombstones_unrecorded_total"] == 17 and samples["kvpool_etcd_errors_total"] == 2
    quiet = StoreCollector("node-1", ChunkStore(dram), dict)  # before the node's publisher exists
    assert {s.name: s.value for f in quiet.collect() for s in f.samples}["kvpool_tombstones_unrecorded_total"] == 0
