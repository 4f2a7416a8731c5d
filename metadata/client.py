"""The one place kvpool talks to etcd: retries, timeouts and error translation.

Every call is bounded: a retriable failure (etcd down, leader change, timeout) is retried with backoff
until ``retry_deadline_s``, then raised as :class:`MetadataUnavailable`; nothing waits forever.  Callers
never see a gRPC or pyetcd exception.

Given several endpoints (the members of one etcd cluster) the client fails over: a member that fails a call is
set aside for a second and the retry goes to the next, and a watch whose member dies resumes on another from the
revision after the last event it delivered, so a member's death loses no event.  With TLS configured every
channel is TLS; a mismatch (a TLS client and a plaintext etcd, or a client without a certificate and a TLS etcd)
is diagnosed at once and raised with its fix, never retried until the deadline.
"""

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc
from pyetcd import transactions as etcd_txn
from pyetcd import utils as etcd_utils

from kvpool.errors import MetadataUnavailable
from kvpool.metadata import tls
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig, parse_endpoint

log = logging.getLogger(__name__)
T = TypeVar("T")

_RETRIABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
_RETRIABLE_EXC = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
)
# Reconnect quickly after etcd restarts; gRPC's default backoff grows to 120 s.
_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # One watch answer carries every key a revision deleted: a node leaving takes all its placements in one revision
    # (~120 B each), past gRPC's default 4 MiB at ~37 k of them, and a watch that cannot take its answer breaks (every
    # cache re-snapshots at once).  The etcd here cannot fragment watch answers (its API predates `fragment`).
    ("grpc.max_receive_message_length", 64 << 20),
]
FAILED_MEMBER_S = 1.0  #: with several endpoints, a member that failed a call is skipped this long

Put = etcd_txn.Put
Get = etcd_txn.Get
Delete = etcd_txn.Delete
Version = etcd_txn.Version  #: a transaction's compare: ``Version(key) == 0`` holds while ``key`` does not exist


def prefix_end(prefix: bytes) -> bytes:
    return bytes(etcd_utils.prefix_range_end(prefix))


def probe(config: MetadataConfig, timeout_s: float = 1.0) -> None:
    """Raise :class:`MetadataUnavailable` at once when no etcd member of ``config`` accepts a TCP connection within
    ``timeout_s``: for a caller that goes on without etcd (an engine's connector) and would rather try again later
    than spend a call's whole retry deadline on an address where nothing listens."""
    failures = []
    for endpoint in config.endpoints:
        try:
            socket.create_connection(parse_endpoint(endpoint), timeout=timeout_s).close()
            return
        except OSError as exc:
            failures.append(f"{endpoint}: {exc.strerror or exc}")
    if failures:
        raise MetadataUnavailable(
            f"no etcd member accepts a connection ({'; '.join(failures)}); check that etcd is running and that "
            f"{ENDPOINTS_ENV} (or --etcd) points at it"
        )


def _retriable(exc: BaseException) -> bool:
    if isinstance(exc, _RETRIABLE_EXC):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in _RETRIABLE_CODES


def _rpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error behind ``exc`` (pyetcd raises its own exception types from inside gRPC's)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.RpcError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class KeyValue:
    """One key of a range or watch answer, detached from protobuf."""

    __slots__ = ("create_revision", "key", "lease", "mod_revision", "value")

    def __init__(self, kv: Any) -> None:
        self.key: bytes = kv.key
        self.value: bytes = kv.value
        self.lease: int = kv.lease
        self.create_revision: int = kv.create_revision
        self.mod_revision: int = kv.mod_revision


class EtcdClient:
    """A thread-safe etcd v3 client (gRPC channels are thread-safe) with bounded retries."""

    def __init__(self, config: MetadataConfig) -> None:
        if not config.endpoints:
            raise MetadataUnavailable(
                f"no etcd endpoints configured: start an embedded etcd (kvpool up) or set {ENDPOINTS_ENV}"
            )
        self.config = config
        self.several = len(config.endpoints) > 1
        creds, opts = tls.credentials(config)
        opts = _CHANNEL_OPTIONS + opts
        endpoints = [
            pyetcd.Endpoint(
                host,
                port,
                secure=config.tls,
                creds=creds,
                time_retry=FAILED_MEMBER_S if self.several else 0.0,
                opts=opts,
            )
            for host, port in map(parse_endpoint, config.endpoints)
        ]
        self._client = pyetcd.MultiEndpointEtcd3Client(
            endpoints=endpoints, timeout=config.request_timeout_s, failover=self.several
        )
        self._lock = threading.Lock()  #: moving from a failed member to the next, for watches
        self.endpoints = ", ".join(config.endpoints)

    def close(self) -> None:
        self._client.close()

    # -- the retry loop ------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T], deadline_s: float | None = None) -> T:
        """Run ``fn`` until it succeeds, fails for good, or ``deadline_s`` (default: config) passes."""
        deadline = time.monotonic() + (self.config.retry_deadline_s if deadline_s is None else deadline_s)
        delay, attempts = 0.05, 0
        while True:
            attempts += 1
            try:
                return fn()
            except (grpc.RpcError, etcd_exc.Etcd3Exception) as exc:
                mismatch = self.tls_mismatch(exc)
                if mismatch:
                    raise MetadataUnavailable(f"{what}: {mismatch}") from None
                if not _retriable(exc):
                    raise MetadataUnavailable(f"etcd at {self.endpoints} refused {what}: {_describe(exc)}") from exc
                if time.monotonic() + delay > deadline:
                    raise MetadataUnavailable(
                        f"etcd at {self.endpoints} unreachable for {what} after {attempts} attempts "
                        f"({_describe(exc)}); check that etcd is running and that {ENDPOINTS_ENV} "
                        "(or --etcd) points at it"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def current(self) -> tuple[str, int]:
        """The member calls go to now (host, port)."""
        with self._lock:
            host, _, port = self._client.endpoint_in_use.netloc.rpartition(":")
        return host, int(port)

    def tls_mismatch(self, exc: BaseException) -> str | None:
        """What is wrong, and the fix, when ``exc`` comes from TLS on one side only or a refused certificate;
        None for any other failure (see :func:`~kvpool.metadata.tls.mismatch`)."""
        rpc = _rpc_error(exc)
        return tls.mismatch(self.config, *self.current(), (rpc.details() or "") if rpc is not None else "")

    def fail_over(self, member: str) -> None:
        """Set ``member`` (``host:port``) aside: it failed a watch, so the next channel is another member's."""
        if self.several:
            with self._lock:
                self._client.endpoints[member].fail()

    def channel(self) -> tuple[str, grpc.Channel]:
        """A member not failed lately (pyetcd's failover picks it) and a channel to it; ``MetadataUnavailable``
        when every member failed within the last :data:`FAILED_MEMBER_S`."""
        with self._lock:
            try:
                channel = self._client.channel
            except (etcd_exc.NoServerAvailableError, ValueError) as exc:
                raise MetadataUnavailable(f"no etcd member of {self.endpoints} answers") from exc
            return self._client.endpoint_in_use.netloc, channel

    # -- key-value ------------------------------------------------------------------------------------

    def get(self, key: bytes, revision: int | None = None) -> KeyValue | None:
        """The value of ``key`` now, or as it was at ``revision`` (``MetadataUnavailable`` once etcd compacted
        that revision away)."""
        at = {} if revision is None else {"revision": revision}
        resp = self.call("get", lambda: self._client.get_response(key, **at))
        return KeyValue(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        """Every key under ``prefix`` (paged); see :meth:`snapshot` for the revision too."""
        return self.snapshot(prefix)[1]

    def snapshot(self, prefix: bytes, page_size: int | None = None) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` at one revision, read in pages.

        One ``get_prefix`` of many keys fails once the answer passes the client's 4 MiB receive limit.
        Pages of ``page_size`` keys, all read at the first page's revision, give the same consistent
        view; a page that is still too large (big values) is halved until it fits.
        """
        limit = page_size or self.config.page_size
        end = prefix_end(prefix)
        start, revision = prefix, 0
        out: list[KeyValue] = []

        def page() -> Any:
            try:
                # no sort asked: etcd returns a range in key order anyway, and a sorted range makes etcd 3.5 read
                # the whole rest of the range for every page (a snapshot grew with the square of the keys)
                return self._client.get_range_response(start, end, limit=limit, revision=revision or None)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and limit > 1:
                    return None  # too many bytes for one answer: halve the page
                raise

        while True:
            resp = self.call("range", page)
            if resp is None:
                limit //= 2
                continue
            if not revision:
                revision = resp.header.revision
            out.extend(KeyValue(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return revision, out
            start = resp.kvs[-1].key + b"\0"

    def revision(self) -> int:
        """The store's current revision."""
        resp = self.call("status", lambda: self._client.get_response(b"\0", count_only=True))
        return int(resp.header.revision)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Put and return the revision of the write."""
        resp = self.call("put", lambda: self._client.put(key, value, lease=lease or None))
        return int(resp.header.revision)

    def delete_prefix(self, prefix: bytes) -> int:
        resp = self.call("delete", lambda: self._client.delete_prefix(prefix))
        return int(resp.deleted)

    def txn(
        self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> tuple[bool, list[Any]]:
        """One transaction: ``(succeeded, responses)``, range answers as lists of :class:`KeyValue`."""
        ok, responses = self.call(
            "transaction", lambda: self._client.transaction(list(compare), list(success), list(failure))
        )
        out: list[Any] = []
        for r in responses:
            if isinstance(r, list):  # a range answer: [(value, KVMetadata), ...]
                out.append([_kv_from_meta(value, meta) for value, meta in r])
            else:
                out.append(r)
        return bool(ok), out

    def write(self, ops: Sequence[Any]) -> int:
        """Puts and deletes in one unconditional transaction; the etcd revision that shows them (from the
        transaction's own reply: no second round trip to learn it)."""
        _, responses = self.txn([], ops)
        revision = 0
        for r in responses:
            kind = r.WhichOneof("response")  # response_put or response_delete_range
            revision = max(revision, int(getattr(r, kind).header.revision))
        return revision

    # -- leases ---------------------------------------------------------------------------------------

    def grant_lease(self, ttl_s: int, deadline_s: float | None = None) -> int:
        lease = self.call("lease grant", lambda: self._client.lease(ttl_s), deadline_s=deadline_s)
        return int(lease.id)

    def refresh_lease(self, lease_id: int, deadline_s: float | None = None) -> int:
        """Keep a lease alive once; returns its remaining TTL, 0 if it has expired."""
        responses = self.call(
            "lease keep-alive", lambda: list(self._client.refresh_lease(lease_id)), deadline_s=deadline_s
        )
        return int(responses[-1].TTL) if responses else 0

    def revoke_lease(self, lease_id: int, deadline_s: float | None = None) -> None:
        self.call("lease revoke", lambda: self._client.revoke_lease(lease_id), deadline_s=deadline_s)

    # -- watch ----------------------------------------------------------------------------------------

    def watch(self, prefix: bytes, start_revision: int, *, prev_kv: bool = False) -> "WatchStream":
        """Every change under ``prefix`` from ``start_revision`` on (``prev_kv``: each event also carries the
        value the key held before); with several members it moves to another when its member fails."""
        return WatchStream(self, prefix, start_revision, prev_kv=prev_kv)


def _kv_from_meta(value: bytes, meta: Any) -> KeyValue:
    kv = KeyValue.__new__(KeyValue)
    kv.key, kv.value, kv.lease = meta.key, value, meta.lease_id
    kv.create_revision, kv.mod_revision = meta.create_revision, meta.mod_revision
    return kv


def _describe(exc: BaseException) -> str:
    rpc = _rpc_error(exc)
    if rpc is not None:
        return f"{rpc.code().name}: {rpc.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class WatchStream:
    """A watch on a prefix from ``start_revision``: iterate for responses, :meth:`cancel` from any thread.

    With several members, a stream that breaks is opened again on another member from the revision after the last
    event delivered (etcd numbers revisions cluster-wide, and sends all events of one revision in one response), for
    up to ``retry_deadline_s`` without an answer.  Otherwise iteration raises :class:`MetadataUnavailable` when the
    stream breaks (etcd died or restarted: a lone etcd may come back empty, so its revisions cannot be trusted) or
    the start revision was compacted away; the caller re-snapshots and watches again.
    """

    def __init__(self, etcd: EtcdClient, prefix: bytes, start_revision: int, *, prev_kv: bool = False) -> None:
        self._etcd, self._prefix, self._prev_kv = etcd, prefix, prev_kv
        self._next = start_revision  #: the first revision not yet delivered
        self._lock = threading.Lock()
        self._cancelled = False
        self._requests: queue.Queue[Any] = queue.Queue()
        self._call: Any = None
        self._member = ""  #: the member the stream is open on
        self._open()

    def _open(self) -> None:
        create = etcdrpc.WatchCreateRequest(
            key=self._prefix, range_end=prefix_end(self._prefix), start_revision=self._next, prev_kv=self._prev_kv
        )
        requests: queue.Queue[Any] = queue.Queue()
        requests.put(etcdrpc.WatchRequest(create_request=create))
        member, channel = self._etcd.channel()
        call = etcdrpc.WatchStub(channel).Watch(iter(requests.get, None), metadata=self._etcd._client.metadata)
        with self._lock:
            self._requests, self._call, self._member = requests, call, member
            if self._cancelled:
                requests.put(None)
                call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            self._requests.put(None)
            self._call.cancel()

    def __iter__(self) -> Iterator[Any]:
        broken_since: float | None = None
        while True:
            try:
                for resp in self._call:
                    broken_since = None
                    if resp.compact_revision:
                        raise MetadataUnavailable(f"watch start revision compacted (now {resp.compact_revision})")
                    if resp.canceled:
                        raise MetadataUnavailable(
                            f"etcd cancelled the watch: {resp.cancel_reason or 'no reason given'}"
                        )
                    if resp.events:
                        self._next = resp.events[-1].kv.mod_revision + 1
                    yield resp
                why = "watch stream ended"
            except grpc.RpcError as exc:
                why = f"watch stream broke: {_describe(exc)}"
            with self._lock:
                if self._cancelled:
                    return
            now = time.monotonic()
            broken_since = now if broken_since is None else broken_since
            if not self._etcd.several or now - broken_since > self._etcd.config.retry_deadline_s:
                raise MetadataUnavailable(why)
            log.info("%s; resuming from revision %d on another member", why, self._next)
            self._etcd.fail_over(self._member)
            time.sleep(0.05)
            try:
                self._open()
            except MetadataUnavailable:
                time.sleep(0.2)  # every member failed within the last second: the next pass tries again
