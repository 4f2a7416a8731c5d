import shutil
from collections.abc import Iterator

import pytest

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import NodeRecord, Placement, Tier
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.metadata.records import encode_node
from kvpool.servers.etcd import EmbeddedEtcd

IDENT = CacheIdentity(model="m", kv_dtype="bf16", layout="all", chunk_size=8)


def placements(keys: list[bytes], node: str = "n1") -> list[Placement]:
    return [
        Placement(key=k, node=node, tier=Tier.DRAM, offset=i, stored=1, size=1, checksum=0) for i, k in enumerate(keys)
    ]


def test_lookups_are_local_and_follow_writes(etcd: EtcdClient, namespace: Namespace, cache: MetadataCache) -> None:
    store = PlacementStore(etcd, namespace)
    keys = chunk_keys(IDENT, range(8 * 64))
    lease = etcd.grant_lease(30)
    store.publish(placements(keys[:40]), lease)
    store.publish(placements(keys[:10], node="n2"), lease)
    etcd.put(namespace.node("n1"), encode_node(NodeRecord("n1", "h", 1)), lease)
    cache.sync()
    assert cache.lookup_prefix(keys) == 40
    assert sorted(p.node for p in cache.replicas(keys[5])) == ["n1", "n2"]
    assert [n.node_id for n in cache.nodes()] == ["n1"]
    store.delete(placements(keys[20:21]))
    cache.sync()
    assert cache.lookup_prefix(keys) == 20
    etcd.revoke_lease(lease)  # everything bound to the lease goes, and the watch sees each delete
    cache.sync()
    assert cache.lookup_prefix(keys) == 0 and cache.nodes() == [] and cache.chunk_count() == 0


def test_snapshot_is_paged(etcd: EtcdClient, namespace: Namespace) -> None:
    """A snapshot larger than one page (and than gRPC's 4 MiB answer limit) arrives whole."""
    keys = chunk_keys(IDENT, range(8 * 3000))
    lease = etcd.grant_lease(30)
    PlacementStore(etcd, namespace).publish(placements(keys), lease)
    for kv_key, big in ((namespace.node(f"big{i}"), b"x" * (1 << 20)) for i in range(5)):
        etcd.put(kv_key, big, lease)  # 5 MiB of (malformed, skipped) node records
    revision, kvs = etcd.snapshot(namespace.root, page_size=2)
    assert len(kvs) == 3005
    with MetadataCache(etcd, namespace) as cache:
        assert cache.chunk_count() == 3000 and cache.malformed == 5
        assert cache.revision >= revision


def test_a_revision_deleting_50k_placements_reaches_the_watch_whole(etcd: EtcdClient, namespace: Namespace) -> None:
    """What a node leaving does to every watch: one revision deletes all its placements, one answer of ~6 MB (past
    gRPC's default 4 MiB) that the watch must take without breaking (no re-snapshot)."""
    keys = chunk_keys(CacheIdentity(model="m", kv_dtype="bf16", layout="all", chunk_size=1), range(50_000))
    PlacementStore(etcd, namespace).publish(placements(keys), 0)
    with MetadataCache(etcd, namespace) as cache:
        cache.sync()
        assert cache.chunk_count() == 50_000
        etcd.delete_prefix(namespace.chunks)  # one revision
        cache.sync()
        assert cache.chunk_count() == 0 and cache.resyncs == 1


def test_malformed_values_are_skipped_not_fatal(etcd: EtcdClient, namespace: Namespace, cache: MetadataCache) -> None:
    good, bad = chunk_keys(IDENT, range(16))
    etcd.put(namespace.replica(bad, "n1"), b"garbage")
    etcd.put(namespace.chunks + b"not-a-key/n1", b"garbage")
    etcd.put(namespace.node("n9"), b"\x92\x01\x02")
    PlacementStore(etcd, namespace).publish(placements([good]), etcd.grant_lease(30))
    cache.sync()
    assert cache.malformed == 3 and cache.lookup_prefix([good, bad]) == 1 and cache.nodes() == []


@pytest.fixture
def private_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own, to kill and restart without disturbing the others."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.mark.parametrize("fresh_data", [False, True], ids=["same-data", "empty-data"])
def test_cache_is_consistent_after_etcd_restart(private_etcd: EmbeddedEtcd, fresh_data: bool) -> None:
    cfg = MetadataConfig(endpoints=(private_etcd.endpoint,), cluster="restart", lease_ttl_s=30, retry_deadline_s=2)
    etcd, ns = EtcdClient(cfg), Namespace(cfg.cluster)
    store = PlacementStore(etcd, ns)
    keys = chunk_keys(IDENT, range(8 * 100))
    store.publish(placements(keys[:60]), etcd.grant_lease(30))
    with MetadataCache(etcd, ns) as cache:
        cache.sync()
        assert cache.lookup_prefix(keys) == 60
        resyncs = cache.resyncs

        private_etcd.kill()
        if fresh_data:
            shutil.rmtree(private_etcd.data_dir)  # etcd comes back empty, at a lower revision
        assert cache.lookup_prefix(keys) == 60  # still served from memory while etcd is down
        private_etcd.start()

        lease = etcd.grant_lease(30)
        store.publish(placements(keys[:5], node="n2"), lease)
        if not fresh_data:
            store.delete(placements(keys[30:31]))
        cache.sync(timeout_s=15)
        assert cache.resyncs > resyncs
        expected = 5 if fresh_data else 30
        assert cache.lookup_prefix(keys) == expected
        assert len(store.held_by("n1")) == (0 if fresh_data else 59)  # etcd agrees
        assert sorted(p.node for p in cache.replicas(keys[0])) == (["n2"] if fresh_data else ["n1", "n2"])
        if fresh_data:  # no stale entry of the old store survives
            assert cache.chunk_count() == 5
    etcd.close()
