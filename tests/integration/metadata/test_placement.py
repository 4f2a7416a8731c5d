"""Placement records against a real etcd: batched publish, read back, delete, malformed values skipped."""

import pytest

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Placement, Tier
from kvpool.errors import MetadataUnavailable
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore

IDENT = CacheIdentity(model="m", kv_dtype="bf16", layout="all", chunk_size=16)


def placement(key: bytes, node: str = "n1", offset: int = 0, tier: Tier = Tier.DRAM) -> Placement:
    return Placement(key=key, node=node, tier=tier, offset=offset, stored=1024, size=4096, checksum=7, codec="fp8")


@pytest.fixture
def store(etcd: EtcdClient, namespace: Namespace) -> PlacementStore:
    return PlacementStore(etcd, namespace)


def test_batch_publish_of_1000_splits_transactions(etcd: EtcdClient, store: PlacementStore) -> None:
    keys = chunk_keys(IDENT, range(16 * 1000))
    lease = etcd.grant_lease(30)
    before = etcd.revision()
    published = [placement(k, offset=i * 4096) for i, k in enumerate(keys)]
    store.publish(published, lease)
    # 1000 placements at 128 per transaction: 8 transactions, each one revision.
    assert etcd.revision() - before == 8
    assert sorted(store.held_by("n1"), key=lambda p: p.offset) == published  # read back exactly


def test_publish_overwrites_and_delete_removes_one_replica(etcd: EtcdClient, store: PlacementStore) -> None:
    keys = chunk_keys(IDENT, range(16 * 200))
    lease = etcd.grant_lease(30)
    store.publish([placement(k) for k in keys], lease)
    store.publish([placement(keys[0], node="n2", tier=Tier.NVME)], lease)
    store.publish([placement(k, offset=3) for k in keys[:5]], lease)  # a chunk moved: its placement is rewritten
    assert {p.key: p.offset for p in store.held_by("n1")} == {k: 3 if i < 5 else 0 for i, k in enumerate(keys)}
    store.delete([placement(keys[0]), placement(keys[150])])
    assert len(store.held_by("n1")) == 198
    assert store.held_by("n2") == [placement(keys[0], node="n2", tier=Tier.NVME)]  # its replica stays


def test_unreachable_etcd_is_a_bounded_error() -> None:
    cfg = MetadataConfig(endpoints=("127.0.0.1:9",), retry_deadline_s=0.5, request_timeout_s=0.2)
    etcd = EtcdClient(cfg)
    with pytest.raises(MetadataUnavailable, match="KVPOOL_ETCD_ENDPOINTS"):
        PlacementStore(etcd, Namespace("x")).publish([placement(b"k" * 32)], lease_id=1)


def test_malformed_values_are_skipped(
    etcd: EtcdClient, namespace: Namespace, store: PlacementStore, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad, wrong = chunk_keys(IDENT, range(48))
    lease = etcd.grant_lease(30)
    store.publish([placement(good)], lease)
    etcd.put(namespace.replica(bad, "n1"), b"\xc1not msgpack")
    etcd.put(namespace.replica(wrong, "n1"), b"\x81\xa1v\x09")  # msgpack {"v": 9}: a future schema
    assert store.held_by("n1") == [placement(good)]
    assert "not msgpack" in caplog.text and "schema version 9" in caplog.text
