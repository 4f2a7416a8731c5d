"""Prefetches a request waits for: the part of its held prefix that is not in its engine's pool node's DRAM (on that
node's NVMe, in the S3 tier, on another node) brought there before the engine loads it
(:meth:`PoolClient.prefetch <kvpool.pool.client.PoolClient.prefetch>`), while the engine schedules other work.

An engine asks for it per request (vLLM: a hint in the request's ``kv_transfer_params``); the request waits until
its prefetch ended or a deadline passed, then is loaded as usual: from DRAM if the prefetch was done, from where the
chunks are otherwise.  Nothing here imports an engine."""

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from kvpool.core.types import Placement, Tier
from kvpool.errors import KvPoolError
from kvpool.prefill_decode.connector_core.counts import EngineCounts

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0  #: the longest :meth:`RequestPrefetches.close` waits for the prefetches still queued


class Connection(Protocol):
    """What prefetching needs of a :class:`~.connection.PoolConnection`: its client, made on first use."""

    error: str  #: why the last attempt to make it failed

    def client(self) -> Any: ...

    @property
    def connected(self) -> Any: ...

    def close(self) -> None: ...


class Replicas(Protocol):
    """What prefetching reads of a watch cache: where each key is held."""

    def replicas(self, key: bytes) -> list[Placement]: ...


class RequestPrefetches:
    """At most one prefetch per request, into the pool node of ``connection``'s client, each run on a thread of its
    own with that client (made there on first use: a client is used by one thread, and an engine that never asks
    for a prefetch makes none).  A request waits for its prefetch at most ``wait_s``; a prefetch that fails is logged
    and counted, never raised: the engine then reads the chunks where they are.

    Counts (:class:`EngineCounts`): ``prefetch_started``, ``prefetch_failed``, ``prefetch_late`` (its request stopped
    waiting first), and the objects it ``prefetch_promoted`` (from the node's NVMe) and ``prefetch_copied`` (read
    from another node or the S3 tier)."""

    def __init__(
        self, connection: Connection, counts: EngineCounts, wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.connection, self.counts, self.wait_s = connection, counts, wait_s
        self._clock = clock  #: kept as an attribute so that tests can move it
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvpool-prefetch")
        #: by request: its prefetch and its deadline (None: the request no longer waits for it)
        self._started: dict[str, tuple[Future[None], float | None]] = {}

    def needed(self, keys: Sequence[bytes], cache: Replicas) -> bool:
        """Whether some of ``keys`` are not in this engine's node's DRAM (before the client exists, its node is not
        known: then yes, and the prefetch finds out)."""
        client = self.connection.connected
        if client is None:
            return bool(keys)
        here = client.node_id
        return any(not any(p.node == here and p.tier == Tier.DRAM for p in cache.replicas(k)) for k in keys)

    def start(self, req_id: str, keys: Sequence[bytes], tenant: str = "") -> None:
        """The prefetch of ``keys`` (charged to ``tenant``) for request ``req_id``, queued; it waits from now on."""
        self.counts.add(prefetch_started=1)
        future = self._thread.submit(self._run, list(keys), tenant)
        self._started[req_id] = (future, self._clock() + self.wait_s)

    def started(self, req_id: str) -> bool:
        return req_id in self._started

    def waiting(self, req_id: str) -> bool:
        """Whether request ``req_id`` still waits for its prefetch: it runs, and its deadline has not passed (when it
        passes, the prefetch is counted late, once, and goes on without the request)."""
        future, deadline = self._started.get(req_id, (None, None))
        if future is None or deadline is None or future.done():
            return False
        if self._clock() < deadline:
            return True
        self.counts.add(prefetch_late=1)
        self._started[req_id] = (future, None)
        return False

    def forget(self, req_id: str) -> None:
        """Request ``req_id`` ended (its prefetch, if still running, finishes on its own)."""
        self._started.pop(req_id, None)

    def _run(self, keys: list[bytes], tenant: str) -> None:
        client = self.connection.client()
        if client is None:
            self._failed(f"the pool is not reachable ({self.connection.error})")
            return
        try:
            done = client.prefetch(keys, "", tenant)  # "": the client's own node, this engine's
        except KvPoolError as exc:
            self._failed(str(exc))
            return
        self.counts.add(prefetch_promoted=done.promoted, prefetch_copied=done.copied)

    def _failed(self, why: str) -> None:
        self.counts.add(prefetch_failed=1)
        log.warning("kvpool: prefetch failed (the load reads the chunks where they are): %s", why)

    def close(self) -> None:
        """Close the client on its thread once the queued prefetches ended (waiting at most :data:`CLOSE_WAIT_S`)."""
        # at interpreter exit (vLLM shuts its engine down from a finalizer) no thread takes work: the process ends
        with contextlib.suppress(RuntimeError, TimeoutError, KvPoolError):
            self._thread.submit(self.connection.close).result(timeout=CLOSE_WAIT_S)
        self._thread.shutdown(wait=False)
