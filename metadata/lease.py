"""A lease kept alive by a thread, and re-established when it is lost.

etcd deletes every key bound to a lease once the lease is not refreshed for its TTL; that is how a dead
node's records and placements vanish.  The keeper refreshes every ``ttl/3``.  If refreshing fails for
longer than the TTL (by the injected clock), or etcd answers that the lease is gone, the lease is
*lost*: everything bound to it has been (or will be) deleted.  The keeper then grants a new lease as
soon as etcd answers and calls ``on_new_lease(lease_id)`` so that the owner can publish its records
again.  The decision logic is :meth:`LeaseKeeper.tick`, callable without the thread.
"""

import contextlib
import enum
import logging
import threading
from collections.abc import Callable

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import MetadataUnavailable
from kvpool.metadata.client import EtcdClient

log = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    ALIVE = "alive"  #: refreshed within the TTL
    UNCERTAIN = "uncertain"  #: the last refresh failed, but the TTL has not run out yet
    LOST = "lost"  #: expired: keys bound to it are gone; a new lease is needed


class LeaseKeeper:
    def __init__(
        self,
        etcd: EtcdClient,
        ttl_s: int,
        on_new_lease: Callable[[int], None],
        *,
        clock: Clock = SYSTEM_CLOCK,
        name: str = "lease",
    ) -> None:
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.clock = clock
        self.name = name
        self._on_new_lease = on_new_lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease_id = etcd.grant_lease(ttl_s)
        self.state = LeaseState.ALIVE
        self.renewals = 0  #: how many times the lease was lost and re-granted
        self._last_ok = clock.monotonic()
        on_new_lease(self.lease_id)

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    def tick(self) -> LeaseState:
        """One keep-alive step: refresh, or decide the lease is lost and replace it."""
        if self.state is LeaseState.LOST:
            self._replace()
            return self.state
        try:
            remaining = self.etcd.refresh_lease(self.lease_id, deadline_s=self.interval_s)
        except MetadataUnavailable as exc:
            if self.clock.monotonic() - self._last_ok > self.ttl_s:
                log.warning("%s %x lost: no refresh for more than %d s (%s)", self.name, self.lease_id, self.ttl_s, exc)
                self.state = LeaseState.LOST
            else:
                self.state = LeaseState.UNCERTAIN
            return self.state
        if remaining <= 0:
            log.warning("%s %x expired in etcd; granting a new one", self.name, self.lease_id)
            self.state = LeaseState.LOST
            self._replace()
        else:
            self.state = LeaseState.ALIVE
            self._last_ok = self.clock.monotonic()
        return self.state

    def _replace(self) -> None:
        # Revoke the old lease first: etcd restores leases when it restarts, and keys still bound to the
        # old one would block re-publishing and then vanish when it expires.
        # It may have expired already (etcd refuses: not found) or etcd may still be down (seen below).
        with contextlib.suppress(MetadataUnavailable):
            self.etcd.revoke_lease(self.lease_id, deadline_s=self.interval_s)
        try:
            lease_id = self.etcd.grant_lease(self.ttl_s, deadline_s=self.interval_s)
        except MetadataUnavailable as exc:
            log.info("%s: etcd still unreachable, cannot grant a new lease yet (%s)", self.name, exc)
            return
        self.lease_id, self.state, self._last_ok = lease_id, LeaseState.ALIVE, self.clock.monotonic()
        self.renewals += 1
        try:
            self._on_new_lease(lease_id)
        except MetadataUnavailable as exc:  # re-publish failed: retry on the next tick with a fresh lease
            log.warning("%s: re-publishing on new lease %x failed (%s)", self.name, lease_id, exc)
            self.state = LeaseState.LOST

    def start(self) -> "LeaseKeeper":
        self._thread = threading.Thread(target=self._run, name=f"kvpool-{self.name}-keeper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # the keeper must outlive any single bad step
                log.exception("%s keeper step failed", self.name)

    def stop(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` delete everything bound to the lease now, not after the TTL."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + self.etcd.config.request_timeout_s + 1)
        if revoke:
            try:
                self.etcd.revoke_lease(self.lease_id)
            except MetadataUnavailable as exc:
                log.warning("%s %x not revoked (%s); it expires in %d s", self.name, self.lease_id, exc, self.ttl_s)
