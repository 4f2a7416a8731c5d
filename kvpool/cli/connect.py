"""How the commands that inspect or use a running pool reach it: its etcd (a synced watch cache), or its
Ray cluster (a ``PoolClient`` from an attached driver)."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvpool.cli import options
from kvpool.errors import SetupError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import Namespace

if TYPE_CHECKING:
    from kvpool.pool.client import PoolClient


@contextmanager
def running_cache(etcd: str | None, cluster: str, command: str) -> Iterator[MetadataCache]:
    """A synced metadata cache of a running pool, whose etcd ``command`` needs."""
    config = options.pool_etcd(etcd, cluster, command)
    client = EtcdClient(config)
    try:
        with MetadataCache(client, Namespace(config.cluster)) as cache:
            yield cache
    finally:
        client.close()


def live_pool(etcd: str | None, cluster: str, command: str) -> tuple[int, tuple[str, ...]]:
    """How many live nodes the running pool has, and its etcd endpoints; ``ConfigError`` when it has none (what an
    engine's config command checks before printing a config that points at the pool)."""
    with running_cache(etcd, cluster, command) as cache:
        nodes = cache.nodes()
        endpoints = tuple(cache.etcd.config.endpoints)
    if not nodes:
        raise SetupError(f"no live pool nodes in cluster '{cluster}': start the pool first (kvpool up / kvpool join)")
    return len(nodes), endpoints


@contextmanager
def attached_client(
    command: str, etcd: str | None, cluster: str, ray_address: str, namespace: str
) -> "Iterator[PoolClient]":
    """A ``PoolClient`` of a running pool, from a driver attached to its Ray cluster."""
    import ray

    from kvpool.pool.client import PoolClient
    from kvpool.pool.config import PoolConfig
    from kvpool.ray_auth import attach

    config = options.pool_etcd(etcd, cluster, command)
    attach(ray_address, namespace=namespace)
    try:
        with PoolClient(PoolConfig(metadata=config, namespace=namespace, metrics_port=-1)) as client:
            yield client
    finally:
        ray.shutdown()
