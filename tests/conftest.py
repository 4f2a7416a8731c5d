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
    Shut down by killing what it started (never ``ray stop``, which would kill every Ray on the box).
    """
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    light = {"num_cpus": 1, "object_store_memory": 96 * 2**20}
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={**light, "node_ip_address": "127.0.0.2", "include_dashboard": False,
                        "dashboard_agent_listen_port": 52365 + 2},
    )  # fmt: skip
    nodes = [cluster.head_node]
    for i in (3, 4):
        nodes.append(cluster.add_node(**light, node_ip_address=f"127.0.0.{i}", dashboard_agent_listen_port=52365 + i))
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield [n.node_id for n in nodes]
    finally:
        ray.shutdown()
        cluster.shutdown()
