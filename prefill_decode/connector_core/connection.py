"""A pool client of an engine process: made when first needed, on the thread that will use it, and tried again
later while the pool cannot be reached (an engine keeps serving without it).  Made, it reaches every pool node at
once (:meth:`PoolClient.connect_peers`): engines make their workers' at start, so their first request pays for no
connection (a scheduler's prefetch client is made on the first prefetch a request asks for)."""

import logging
import time
from typing import Any

from kvpool.errors import KvPoolError
from kvpool.prefill_decode.connector_core.settings import PoolSettings

log = logging.getLogger(__name__)

RETRY_S = 5.0  #: a pool that could not be reached is tried again after this (meanwhile: misses, no saves)
#: the longest an engine's start waits for its connection to the pool; past it the engine starts without (misses, no
#: saves) and connects in the background.  Its first request then no longer pays for the connection.
START_WAIT_S = 60.0


class PoolConnection:
    """The :class:`~kvpool.pool.client.PoolClient` of an engine process, attached to the pool of ``settings``
    (``ray.init`` first where the process is not a Ray driver yet).  Not thread-safe, as the client is not: one
    thread (a connector's I/O thread, or its prefetch thread) calls :meth:`client` and uses what it returns."""

    def __init__(self, settings: PoolSettings, clock: Any = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock  #: kept as an attribute so that tests can move it
        self._client: Any = None
        self._next_try = 0.0
        self.error = ""  #: why the last attempt failed ("" before any, or once connected)

    def client(self) -> Any:
        """The client, or None while the pool cannot be reached (tried again every :data:`RETRY_S`)."""
        if self._client is not None or self._clock() < self._next_try:
            return self._client
        self._next_try = self._clock() + RETRY_S
        try:
            import ray

            from kvpool.metadata.client import probe
            from kvpool.pool.client import PoolClient
            from kvpool.ray_auth import attach

            s = self.settings
            probe(s.metadata())  # nothing listening where etcd should be: a miss now, not after its retries
            if not ray.is_initialized():
                kw: dict[str, Any] = {"_node_ip_address": s.node_ip} if s.node_ip else {}
                attach(s.ray_address, s.ray_token_path or None, namespace=s.namespace, log_to_driver=False, **kw)
            self._client = PoolClient(s.pool())
            self.error = ""
            peers = self._client.connect_peers()  # now, not in the first request that reads from another node
            log.info("kvpool: connected to the pool, %d peer node(s) ready for one-sided reads", peers)
        except (KvPoolError, ConnectionError, RuntimeError) as exc:
            self.error = str(exc)
            log.warning("kvpool: pool not reachable (%s); loads miss and saves are skipped until it is", exc)
        return self._client

    @property
    def connected(self) -> Any:
        """The client if one was made (None otherwise); never tries to make one."""
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
