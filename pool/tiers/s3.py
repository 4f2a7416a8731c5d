"""The remote tier: chunks kept as objects in an S3-compatible store, below DRAM and NVMe.

Object layout.  One object per stored chunk, named ``<prefix>/<cluster>/<hex of codec_key(key, codec)>`` in
``bucket``: ``cluster`` keeps several pools apart in one bucket, and the codec is part of the identity
(:func:`~kvpool.pool.tiers.codecs.codec_key`), so a chunk stored raw and the same chunk stored int4 are two objects
that never overwrite each other.  The object's bytes are exactly what the node would hold in DRAM (the codec's
output, checksummed by the pool like any other replica); nothing else is stored with it.  With ``encryption`` set,
those bytes are sealed (:mod:`~kvpool.pool.tiers.crypto`, codec name ``...+aes256gcm``) before they are uploaded: the
object store sees ciphertext only, and a sealed chunk is another object than the same chunk unsealed.

Endpoint and credentials.  Empty fields fall back to boto3's own resolution, so a deployment can configure the
tier the way it configures any AWS tool: ``endpoint_url`` empty means ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` (or the AWS config file), else AWS itself; ``access_key_id``/``secret_access_key`` empty
mean boto3's credential chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws/credentials``,
``AWS_PROFILE``, an instance role); ``region`` empty means ``AWS_REGION``, ``AWS_DEFAULT_REGION`` or the
config file, else ``us-east-1``.  Requests use path-style addressing (``endpoint/bucket/key``), which every
S3-compatible server accepts, and time out after ``timeout_s`` with one retry, so a dead endpoint costs a
bounded wait, not a hang.

Errors.  Every boto3/botocore failure becomes a :class:`~kvpool.errors.RemoteUnavailable` whose message names
the endpoint and bucket and says what to do: the endpoint down or unreachable (start the server, fix
``endpoint_url``), credentials refused with 403 (fix the keys), the bucket missing (create it, fix ``bucket``),
anything else the server answers (see its log).  The one exception is an object that is not there on
:meth:`RemoteStore.get`: that is a :class:`~kvpool.errors.ChunkNotFound`, a plain miss.

Cleanup.  A remote placement belongs to no node: it is recorded under the holder name ``RemoteConfig.name``
and bound to no node lease, so it outlives every node (that is the point of the tier).  Its object is deleted
when the pool removes the chunk; objects whose placement is gone (a node died between the upload and the
publication, or between the unpublication and the delete) are orphans, which ``kvpool gc`` finds with
:meth:`RemoteStore.list_objects` and deletes with :meth:`RemoteStore.delete_names`.  An S3 lifecycle rule on
``<prefix>/<cluster>/`` can also expire old objects: a chunk whose object expired is a miss, never wrong data.
"""

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from kvpool.core.config import Positive, checked
from kvpool.core.types import Tier
from kvpool.errors import ChunkNotFound, ConfigError, RemoteUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.config import Name
from kvpool.metadata.placement import PlacementStore
from kvpool.pool.tiers.codecs import Buffer, codec_key
from kvpool.pool.tiers.s3_config import GC_GRACE_S, RemoteConfig

DELETE_BATCH = 1000  # the most keys one DeleteObjects request may name
DEFAULT_REGION = "us-east-1"

# Error codes S3 (and the compatible servers) answer when the credentials are refused or lack a permission.
_CREDENTIAL_CODES = frozenset(
    {
        "403",
        "AccessDenied",
        "AllAccessDisabled",
        "AuthorizationHeaderMalformed",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
    }
)
_CONNECTION_ERRORS = (
    botocore.exceptions.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ...
    botocore.exceptions.HTTPClientError,  # ResponseStreamingError, a connection dropped mid-body
    botocore.exceptions.IncompleteReadError,
)
_NO_CREDENTIALS = (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)


@dataclass(frozen=True)
class RemoteObject:
    """One object of the remote tier, as listed."""

    name: str  #: the full object key, ``<prefix>/<cluster>/<hex>``
    size: int  #: bytes
    modified: float  #: last modified, seconds since the epoch


class RemoteStore:
    """Chunks as objects in one S3 bucket, for one cluster.

    Thread-safe: boto3 clients are, and ``counters`` (``puts``, ``gets``, ``misses``, ``deletes``,
    ``bytes_put``, ``bytes_got``, ``errors``) is updated under a lock.  ``max_connections`` is the size of
    the client's connection pool: as many requests as that run at once.
    """

    @checked
    def __init__(self, config: RemoteConfig, cluster: Name, *, max_connections: Positive = 32) -> None:
        if not config.enabled:
            raise ConfigError(
                "bucket is empty, so the remote tier is off: set RemoteConfig.bucket (a pool's: remote.bucket) to use it"
            )
        self.config = config
        self.cluster = cluster
        self.bucket = config.bucket
        self.root = f"{config.prefix}/{cluster}/"  #: every object of this store is named under it
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id or None,
            aws_secret_access_key=config.secret_access_key or None,
        )
        self.region = config.region or os.environ.get("AWS_REGION") or session.region_name or DEFAULT_REGION
        self._client: Any = session.client(
            "s3",
            endpoint_url=config.endpoint_url or None,
            region_name=self.region,
            config=botocore.config.Config(
                connect_timeout=config.timeout_s,
                read_timeout=config.timeout_s,
                retries={"max_attempts": 2, "mode": "standard"},
                max_pool_connections=max_connections,
                s3={"addressing_style": "path"},
            ),
        )
        #: where requests go: ``endpoint_url``, or what boto3 resolved from the environment
        self.endpoint: str = self._client.meta.endpoint_url
        self._lock = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets", "misses", "deletes", "bytes_put", "bytes_got", "errors"), 0
        )

    def object_name(self, key: bytes, codec: str) -> str:
        """The object that holds chunk ``key`` stored with ``codec``."""
        return self.root + codec_key(key, codec).hex()

    def put(self, key: bytes, codec: str, data: Buffer) -> None:
        """Store ``data`` as the object of ``(key, codec)``, replacing any previous one."""
        name = self.object_name(key, codec)
        # botocore wants bytes or a seekable file; a memoryview is copied once (cheap next to the upload).
        body = data if isinstance(data, (bytes, bytearray)) else memoryview(data).tobytes()
        with self._translate("put", name):
            self._client.put_object(Bucket=self.bucket, Key=name, Body=body)
        self._count(puts=1, bytes_put=len(body))

    def get(self, key: bytes, codec: str) -> bytes:
        """The bytes of ``(key, codec)``; ``ChunkNotFound`` if there is no such object (a miss)."""
        name = self.object_name(key, codec)
        with self._translate("get", name, missing_is_miss=True):
            response = self._client.get_object(Bucket=self.bucket, Key=name)
            with contextlib.closing(response["Body"]) as body:
                data: bytes = body.read()  # botocore checks the length against Content-Length
        self._count(gets=1, bytes_got=len(data))
        return data

    def delete(self, items: Sequence[tuple[bytes, str]]) -> None:
        """Delete the objects of these ``(key, codec)`` pairs; ones that do not exist are fine."""
        self.delete_names([self.object_name(key, codec) for key, codec in items])

    def delete_names(self, names: Sequence[str]) -> None:
        """Delete objects by name (as :meth:`list_objects` gives them), ``DELETE_BATCH`` a request.

        Names outside this store's ``root`` are refused with ``ConfigError``, so a bad caller cannot delete
        another cluster's objects.  Missing objects are fine; objects the server refused to delete raise
        ``RemoteUnavailable`` after every batch has been tried.
        """
        foreign = [n for n in names if not isinstance(n, str) or not n.startswith(self.root)]
        if foreign:
            raise ConfigError(f"names must be objects of this store (under {self.root!r}), got {foreign[0]!r}")
        failed: list[dict[str, Any]] = []
        for start in range(0, len(names), DELETE_BATCH):
            batch = names[start : start + DELETE_BATCH]
            with self._translate("delete", batch[0]):
                response = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": n} for n in batch], "Quiet": True}
                )
            errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            failed += errors
            self._count(deletes=len(batch) - len(errors))
        if failed:
            self._count(errors=1)
            first = failed[0]
            raise RemoteUnavailable(
                f"S3 at {self.endpoint} refused to delete {len(failed)} of {len(names)} objects in bucket "
                f"{self.bucket!r} (first: {first.get('Key')}: {first.get('Code')} {first.get('Message')}); "
                "check the credentials' delete permission on the bucket"
            )

    def list_objects(self) -> Iterator[RemoteObject]:
        """Every object under ``root`` (this cluster's), one listing page (1000 objects) fetched at a time."""
        pages = iter(self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.root))
        while True:
            with self._translate("list", self.root):
                page = next(pages, None)
            if page is None:
                return
            for item in page.get("Contents", ()):
                yield RemoteObject(name=item["Key"], size=int(item["Size"]), modified=item["LastModified"].timestamp())

    def check(self) -> None:
        """Raise ``RemoteUnavailable`` (saying what to fix) unless the bucket answers with these credentials."""
        with self._translate("check", ""):
            self._client.head_bucket(Bucket=self.bucket)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                self.counters[name] += n

    @contextlib.contextmanager
    def _translate(self, op: str, name: str, *, missing_is_miss: bool = False) -> Iterator[None]:
        """botocore's exceptions as ``RemoteUnavailable`` (or ``ChunkNotFound`` for a missing object)."""
        try:
            yield
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if missing_is_miss and code in ("NoSuchKey", "404", "NotFound"):
                self._count(misses=1)
                raise ChunkNotFound(f"{name} is not in bucket {self.bucket!r} at {self.endpoint}: a miss") from None
            self._count(errors=1)
            raise RemoteUnavailable(self._explain(op, name, exc)) from exc
        except _NO_CREDENTIALS as exc:
            self._count(errors=1)
            raise RemoteUnavailable(
                f"S3 {op} at {self.endpoint}: {exc}; set access_key_id/secret_access_key, or AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials"
            ) from exc
        except _CONNECTION_ERRORS as exc:
            self._count(errors=1)
            where = "endpoint_url" if self.config.endpoint_url else "AWS_ENDPOINT_URL (endpoint_url is empty)"
            raise RemoteUnavailable(
                f"S3 {op} of {self._target(name)} failed: {exc} (timeout {self.config.timeout_s:g} s, retried "
                f"once); start the S3 server at {self.endpoint} or fix {where}"
            ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            self._count(errors=1)
            raise RemoteUnavailable(f"S3 {op} of {self._target(name)} at {self.endpoint} failed: {exc}") from exc

    def _target(self, name: str) -> str:
        return f"{self.bucket}/{name}" if name else f"bucket {self.bucket}"

    def _explain(self, op: str, name: str, exc: botocore.exceptions.ClientError) -> str:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        said = f"HTTP {status}" + (f" {code}" if code and code != str(status) else "")
        said += f": {error['Message']}" if error.get("Message") else ""
        if code == "NoSuchBucket" or (op == "check" and code in ("404", "NotFound")):
            return (
                f"bucket {self.bucket!r} does not exist at {self.endpoint} ({said}); "
                f"create bucket {self.bucket} or fix bucket"
            )
        if code in _CREDENTIAL_CODES or status == 403:
            keys = (
                "access_key_id/secret_access_key"
                if self.config.access_key_id
                else "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (access_key_id is empty)"
            )
            return (
                f"S3 at {self.endpoint} refused the credentials for {op} in bucket {self.bucket!r} ({said}); "
                f"check {keys} and the identity's permissions on the bucket"
            )
        hint = "the server is failing or overloaded: retry later" if isinstance(status, int) and status >= 500 else ""
        return f"S3 {op} of {self._target(name)} at {self.endpoint} failed ({said}); {hint or 'see the S3 server log'}"


def collect_garbage(
    store: RemoteStore, cache: MetadataCache, placements: PlacementStore, grace_s: float = GC_GRACE_S
) -> tuple[int, int]:
    """Reconcile the remote tier with etcd: delete the objects no placement names, unless younger than
    ``grace_s`` (a flush publishes its placements just after its uploads), and drop the placements whose
    object is gone.  Returns ``(objects deleted, placements dropped)``."""
    cache.sync()
    named = {
        store.object_name(p.key, p.codec): p
        for _, replicas in cache.chunks()
        for p in replicas
        if p.tier is Tier.REMOTE
    }
    objects = list(store.list_objects())
    present = {o.name for o in objects}
    now = time.time()
    orphans = [o.name for o in objects if o.name not in named and now - o.modified > grace_s]
    store.delete_names(orphans)
    dangling = [p for name, p in named.items() if name not in present]
    placements.delete(dangling)
    return len(orphans), len(dangling)
