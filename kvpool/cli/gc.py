"""``kvpool gc``: reconcile the remote tier with etcd."""

import typer

from kvpool.cli import connect, options, root
from kvpool.errors import ConfigError
from kvpool.metadata.namespace import Namespace
from kvpool.pool.tiers.s3_config import GC_GRACE_S, RemoteConfig


@root.app.command("gc")
def remote_gc(
    s3_bucket: str = options.S3_BUCKET,
    s3_endpoint: str = options.S3_ENDPOINT,
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    grace: float = typer.Option(
        GC_GRACE_S,
        "--grace",
        min=0,
        help="Leave objects younger than this (s): flushes in flight.",
    ),
) -> None:
    """Reconcile the remote tier with etcd: delete orphan objects, drop placements of missing ones.

    Remote placements are on no node's lease (they outlive nodes): PoolClient.remove, this command and an
    S3 lifecycle rule on the bucket are what remove them.  Objects no placement names are deleted once older
    than --grace; placements whose object is gone are dropped (a reader would drop them too)."""
    from kvpool.metadata.placement import PlacementStore
    from kvpool.pool.tiers.s3 import RemoteStore, collect_garbage

    with root.errors(), connect.running_cache(etcd, cluster, "gc") as cache:
        if not s3_bucket:
            raise ConfigError("--s3-bucket (or KVPOOL_S3_BUCKET): the bucket of the remote tier to clean")
        with RemoteStore(RemoteConfig(bucket=s3_bucket, endpoint_url=s3_endpoint), cluster) as store:
            placements = PlacementStore(cache.etcd, Namespace(cluster))
            deleted, dropped = collect_garbage(store, cache, placements, grace)
        root.console.print(
            f"remote tier {store.endpoint}/{s3_bucket}: {deleted} orphan objects deleted, "
            f"{dropped} placements of missing objects dropped",
            soft_wrap=True,
        )
