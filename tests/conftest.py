"""Shared fixtures: one real etcd server for the session, a fresh cluster namespace per test."""

import uuid
from collections.abc import Iterator

import pytest

from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.etcd_server import EmbeddedEtcd
from kvpool.metadata.namespace import Namespace


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def metadata_config(etcd_server: EmbeddedEtcd) -> MetadataConfig:
    """Points at the session's etcd, under a cluster name no other test uses."""
    return MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2)


@pytest.fixture
def etcd(metadata_config: MetadataConfig) -> Iterator[EtcdClient]:
    client = EtcdClient(metadata_config)
    yield client
    client.delete_prefix(Namespace(metadata_config.cluster).root)
    client.close()


@pytest.fixture
def namespace(metadata_config: MetadataConfig) -> Namespace:
    return Namespace(metadata_config.cluster)


@pytest.fixture
def cache(etcd: EtcdClient, namespace: Namespace) -> Iterator[MetadataCache]:
    with MetadataCache(etcd, namespace) as c:
        yield c


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[list[str]]:
    """One real multi-node Ray cluster for the whole session: a head and two nodes on 127.0.0.2-4.

    Returns the Ray node ids, head first; the test process is a driver attached to the head.
    """
    from kvpool.pool.local_cluster import LocalRayCluster

    with LocalRayCluster(nodes=3) as cluster:
        yield cluster.node_ids()
