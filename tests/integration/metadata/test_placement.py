import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.errors import MetadataUnavailable
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.metadata.records import Placement, Tier
from kvpool.pool.keys import CacheIdentity, chunk_keys

PROCS = str(Path(__file__).with_name("procs.py"))
IDENT = CacheIdentity(model="m", kv_dtype="bf16", layout="all", chunk_size=16)


def placement(key: bytes, node: str = "n1", offset: int = 0, tier: Tier = Tier.DRAM) -> Placement:
    return Placement(key=key, node=node, tier=tier, segment="seg0", offset=offset, length=4096, checksum=7,
                     created=1.5, last_access=2.5)  # fmt: skip


@pytest.fixture
def store(etcd: EtcdClient, namespace: Namespace) -> PlacementStore:
    return PlacementStore(etcd, namespace)


def test_batch_publish_of_1000_splits_transactions(etcd: EtcdClient, store: PlacementStore) -> None:
    keys = chunk_keys(IDENT, range(16 * 1000))
    lease = etcd.grant_lease(30)
    before = etcd.revision()
    result = store.publish([placement(k, offset=i * 4096) for i, k in enumerate(keys)], lease)
    assert len(result.created) == 1000 and not result.existing
    # 1000 placements at 128 per transaction: 8 transactions, each one revision.
    assert etcd.revision() - before == 8
    assert store.lookup_prefix(keys) == 1000
    [p] = store.replicas(keys[999])
    assert p == placement(keys[999], offset=999 * 4096)


def test_create_if_absent_reports_existing_and_creates_the_rest(etcd: EtcdClient, store: PlacementStore) -> None:
    keys = chunk_keys(IDENT, range(16 * 10))
    lease = etcd.grant_lease(30)
    store.publish([placement(k, offset=1) for k in keys[3:6]], lease)
    result = store.publish([placement(k, offset=2) for k in keys], lease)
    assert {p.key for p in result.existing} == set(keys[3:6])
    assert {p.key for p in result.created} == set(keys) - set(keys[3:6])
    assert store.replicas(keys[4])[0].offset == 1  # the first writer's value stands
    assert store.publish([placement(k, offset=3) for k in keys[3:6]], lease, if_absent=False).created
    assert store.replicas(keys[4])[0].offset == 3


def test_retried_publish_counts_its_own_writes_as_created(etcd: EtcdClient, store: PlacementStore) -> None:
    keys = chunk_keys(IDENT, range(16 * 4))
    lease = etcd.grant_lease(30)
    ps = [placement(k) for k in keys]
    store.publish(ps, lease)
    again = store.publish(ps, lease)  # as if the first transaction's answer had been lost
    assert len(again.created) == 4 and not again.existing


def test_replicas_delete_and_longest_prefix(etcd: EtcdClient, store: PlacementStore) -> None:
    keys = chunk_keys(IDENT, range(16 * 300))
    lease = etcd.grant_lease(30)
    store.publish([placement(k) for k in keys[:200]], lease)
    store.publish([placement(keys[0], node="n2", tier=Tier.NVME)], lease)
    assert sorted(p.node for p in store.replicas(keys[0])) == ["n1", "n2"]
    assert store.lookup_prefix(keys) == 200  # spans two transactions of 128
    store.delete([placement(keys[150])])
    assert store.lookup_prefix(keys) == 150
    store.delete([placement(keys[0])])
    assert store.lookup_prefix(keys) == 150  # n2's replica still holds chunk 0
    assert store.lookup_prefix([]) == 0


def test_create_if_absent_race_between_two_processes(metadata_config: MetadataConfig, store: PlacementStore) -> None:
    """Two processes publish the same 300 replica keys at once: each key has exactly one winner."""
    racers = []
    for tag in (1, 2):
        args = {"endpoint": metadata_config.endpoints[0], "cluster": metadata_config.cluster, "chunks": 300, "tag": tag}
        p = subprocess.Popen([sys.executable, PROCS, "racer", json.dumps(args)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert json.loads(p.stdout.readline())["ready"]  # type: ignore[union-attr]
        racers.append(p)
    for p in racers:
        p.stdin.write("go\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in racers]
    won = [set(r["created"]) for r in results]
    assert not won[0] & won[1]
    assert len(won[0] | won[1]) == 300
    for r, other in zip(results, reversed(won), strict=True):
        assert set(r["existing"]) == other
    for tag, keys in zip((1, 2), won, strict=True):  # etcd holds each winner's own value
        for hexkey in list(keys)[:20]:
            assert store.replicas(bytes.fromhex(hexkey))[0].checksum == tag


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
    assert store.replicas(bad) == [] and store.replicas(wrong) == []
    assert store.lookup_prefix([good, bad, wrong]) == 1
    assert "not msgpack" in caplog.text and "schema version 9" in caplog.text
