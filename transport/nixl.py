"""``NixlTransport``: one-sided UCX READ/WRITE through NIXL.

NIXL's bundled UCX drives RDMA NICs in production and shared memory (posix, cma) or TCP on one host.
kvpool sets UCX defaults that work on a CPU-only host and keep TCP on loopback unless the user has set
them (``UCX_TLS``, ``UCX_NET_DEVICES``, ``UCX_WARN_UNUSED_ENV_VARS``); they must be in the environment
before the first agent starts.

Progress: an initiator drives UCX itself while it polls a transfer.  A target (``serve=True``) must
progress too, or connections it never initiates are not wired up and READs over TCP are not served.  It runs
NIXL's UCX progress thread, which sleeps in ``poll`` on the UCX worker's event fd (``ucp_worker_arm``) and wakes
at once for any traffic, at the latest after ``PROGRESS_TIMEOUT_US``.  NIXL's Python wrapper hard-codes that
timeout to 0, a thread that spins a whole core per process, so :func:`_agent` hands it ours.  Idle, a
target costs ~0.1 % of a core (a thread of our own that progressed every millisecond cost ~4 %, each wake-up
30-50 us on these VMs; figures.md, row progress; ``bench/transfer.py`` prints it).  Every call kvpool makes into
the agent holds one lock.

Fences: a READ that passes its deadline is not released.  NIXL's ``releaseXferReq`` on a handle still in
progress asks the backend to cancel it; the UCX backend cancels its UCX requests (``ucp_request_cancel``) and
reports success, but a cancel of a one-sided GET is not a promise that no more bytes arrive (the target's worker
or the NIC may be serving it still).  Measured here over TCP: a 32 MiB READ from a SIGSTOPped peer, released
while in progress (no error, no warning), landed whole in its destination once the peer was continued.  So a
released-but-late READ could land after the caller retried from another replica and verified what it got.
Instead the handle stays alive on a fence list with the local ranges it writes; :class:`TransferInFlight` tells
the caller, and any later transfer touching a fenced range is refused until NIXL
reports that handle finished (done or failed), when it is released.  Waiting out the handle instead would make the
short deadline of unpinned reads mean nothing; refusing the memory is the cheap way that stays correct.
"""

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from kvpool.errors import ConfigError, TransferError, TransferInFlight
from kvpool.transport.base import NixlDescriptor, NixlRegion, Op, Transport, decode_descriptor, pop_notification

log = logging.getLogger(__name__)

#: UCX's TCP transport moves data in segments of its TX/RX segment size (8 KiB by default).  A READ over TCP is
#: served by the target's worker, one segment per step, so with 8 KiB segments a READ over TCP ran well below a
#: WRITE; with 256 KiB segments it runs faster than one.  Figures: docs/figures.md, row ucx-segments.
TCP_SEGMENT = "256k"
UCX_DEFAULTS = {
    "UCX_TLS": "posix,cma,tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_TX_SEG_SIZE": TCP_SEGMENT,
    "UCX_TCP_RX_SEG_SIZE": TCP_SEGMENT,
}
#: how often a caller waiting for a notification progresses the agent
PROGRESS_INTERVAL_S = 0.001
#: the longest a target's progress thread sleeps when no UCX event wakes it (microseconds)
PROGRESS_TIMEOUT_US = 100_000
MAX_PENDING_NOTIFS = 10_000


def apply_ucx_defaults() -> None:
    """kvpool's UCX defaults, for whatever the user has not set.  On a host without RDMA devices UCX's
    InfiniBand modules are not loaded: they have nothing to drive, and the libnl-route they pull in
    crashes in its exit-time destructor (a segfault after every process that started an agent)."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not (os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")):
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")


_AGENT_LOCK = threading.Lock()  #: while a NIXL agent is made with the wrapper's config class swapped


def _agent(name: str, serve: bool) -> Any:
    """A NIXL agent with the UCX backend, with a progress thread that sleeps when idle where ``serve``."""
    from nixl_cu12 import _api

    config = _api.nixl_agent_config(enable_prog_thread=serve, backends=["UCX"])
    base = _api.nixlBind.nixlAgentConfig

    class WithTimeout(base):  # type: ignore[misc,valid-type]
        """``nixl_agent`` sets ``pthrDelay = 0`` on the config it makes: keep ours instead."""

        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, PROGRESS_TIMEOUT_US if key == "pthrDelay" else value)

    with _AGENT_LOCK:
        _api.nixlBind.nixlAgentConfig = WithTimeout
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base


class NixlTransport(Transport):
    def __init__(self, name: str | None = None, *, serve: bool = False, scope: str = "") -> None:
        """``serve``: this process is a target others read from and write to (a pool node).
        ``scope`` (the cluster name): descriptors of another scope are refused by :meth:`connect`."""
        apply_ucx_defaults()
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not an INFO line per agent; NIXL_LOG_LEVEL=INFO shows them
        self.name = name or f"kvpool-{uuid.uuid4().hex[:12]}"
        try:
            self._agent = _agent(self.name, serve)
        except Exception as exc:
            raise TransferError(f"NIXL agent {self.name} could not start: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX backend here; reinstall nixl-cu12")
        self.scope = scope
        self._lock = threading.Lock()
        self._notified = threading.Condition(self._lock)
        self._notifs: list[tuple[str, bytes]] = []  #: (peer, message), oldest first
        self._regions: dict[str, tuple[int, int]] = {}
        self._reg_descs: dict[str, Any] = {}
        self._peers: dict[str, dict[str, tuple[int, int]]] = {}
        self._fenced: list[tuple[Any, list[tuple[int, int]]]] = []  #: (live handle, local (address, length)s)

    def _poll_notifs(self) -> None:
        """Progress UCX and collect notifications (the lock is held)."""
        new = [(peer, msg) for peer, msgs in self._agent.get_new_notifs().items() for msg in msgs]
        if new:
            self._notifs.extend(new)
            del self._notifs[:-MAX_PENDING_NOTIFS]  # nobody waits for the oldest ones
            self._notified.notify_all()

    def wait_notification(self, message: bytes, timeout_s: float) -> str:
        """Wait for a peer's transfer that carried ``notify=message``; returns that peer's id."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if (peer := pop_notification(self._notifs, message)) is not None:
                    return peer
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(f"no notification {message!r} within {timeout_s} s")
                self._poll_notifs()
                self._notified.wait(min(remaining, PROGRESS_INTERVAL_S))

    def register(self, name: str, address: int, length: int) -> None:
        if name in self._regions:
            raise ConfigError(f"region {name!r} is registered already")
        with self._lock:
            self._reg_descs[name] = self._agent.register_memory([(address, length, 0, name)], "DRAM")
        self._regions[name] = (address, length)

    def deregister(self, name: str) -> None:
        with self._lock:
            self._agent.deregister_memory(self._reg_descs.pop(name))
        del self._regions[name]

    @property
    def registrations(self) -> int:
        """How many memory regions are registered now (a leak shows as a count that only grows)."""
        return len(self._regions)

    def descriptor(self) -> bytes:
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        regions = {name: NixlRegion(address, length) for name, (address, length) in self._regions.items()}
        return msgspec.msgpack.encode(
            NixlDescriptor(v=1, name=self.name, scope=self.scope, agent=metadata, regions=regions)
        )

    def connect(self, descriptor: bytes) -> str:
        name, agent, regions = parse_descriptor(descriptor, self.scope)
        if name not in self._peers:  # NIXL refuses to load the same agent twice
            try:
                with self._lock:
                    self._agent.add_remote_agent(agent)
            except Exception as exc:  # nixl raises its own types
                raise TransferError(f"NIXL refused the descriptor of {name}: {exc}") from exc
        self._peers[name] = regions
        return name

    def disconnect(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            with self._lock:
                self._agent.remove_remote_agent(peer)

    def read(self, peer: str, ops: Sequence[Op], timeout_s: float, notify: bytes = b"") -> None:
        self._transfer("READ", peer, ops, timeout_s, notify)

    def write(self, peer: str, ops: Sequence[Op], timeout_s: float, notify: bytes = b"") -> None:
        self._transfer("WRITE", peer, ops, timeout_s, notify)

    def _transfer(self, op: str, peer: str, ops: Sequence[Op], timeout_s: float, notify: bytes) -> None:
        if not ops:
            return
        regions = self._peers.get(peer)
        if regions is None:
            raise TransferError(f"unknown peer {peer!r}: connect() its descriptor first")
        remote = []
        for o in ops:
            base, length = regions.get(o.region, (0, -1))
            if length < 0:
                raise TransferError(f"peer {peer} has no region {o.region!r}")
            if o.remote_offset < 0 or o.remote_offset + o.length > length:
                raise TransferError(f"range [{o.remote_offset}, +{o.length}) is outside {o.region!r} ({length} bytes)")
            remote.append((base + o.remote_offset, o.length, 0))
        with self._lock:
            self._run(op, peer, remote, ops, timeout_s, notify)

    @property
    def fencing(self) -> bool:
        """Whether some READ that passed its deadline has not been seen to end yet (then :meth:`fenced` looks)."""
        return bool(self._fenced)

    def fenced(self, address: int, length: int) -> bool:
        """Whether a READ that passed its deadline may still write into ``[address, +length)``."""
        if not self._fenced:  # the common case, without the lock
            return False
        with self._lock:
            return self._overlaps_fence([(address, length)])

    def _overlaps_fence(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Release fenced handles NIXL reports finished, then whether one left writes into ``ranges`` (lock held)."""
        live = []
        for handle, spans in self._fenced:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:  # nixl raises its own types: the transfer is over (failed), the handle unusable
                state = "ERR"
            if state == "PROC":
                live.append((handle, spans))
            else:
                self._release(handle)
        self._fenced = live
        return any(a < b + m and b < a + n for _, spans in live for b, m in spans for a, n in ranges)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # nixl raises its own types; a handle it refuses is leaked, never reused
            log.warning("NIXL transfer handle not released: %s", exc)

    def _run(
        self, op: str, peer: str, remote: list[tuple[int, int, int]], ops: Sequence[Op], timeout_s: float, notify: bytes
    ) -> None:
        spans = [(o.local_address, o.length) for o in ops]
        if self._fenced and self._overlaps_fence(spans):
            raise TransferInFlight(f"{op} refused: a READ that timed out may still land in its local memory")
        local = self._agent.get_xfer_descs([(o.local_address, o.length, 0) for o in ops], "DRAM")
        handle = None
        try:
            handle = self._agent.initialize_xfer(op, local, self._agent.get_xfer_descs(remote, "DRAM"), peer, notify)
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    self._fenced.append((handle, spans))
                    handle = None  # kept alive, released once NIXL says it finished
                    raise TransferInFlight(
                        f"{op} of {sum(o.length for o in ops)} bytes from {peer} timed out after {timeout_s} s; "
                        "its local memory is fenced until the transfer ends"
                    )
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{op} with {peer} failed (NIXL state {state}); the peer may be dead")
        except TransferError:
            raise
        except Exception as exc:  # nixl raises its own types (nixlBackendError, ...)
            raise TransferError(f"{op} with {peer} failed: {exc}") from exc
        finally:
            if handle is not None:
                self._release(handle)

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        for name in list(self._reg_descs):
            self.deregister(name)


def parse_descriptor(descriptor: bytes, scope: str) -> tuple[str, bytes, dict[str, tuple[int, int]]]:
    """``(peer name, NIXL agent metadata, regions as name → (address, length))`` of a descriptor made by
    :meth:`NixlTransport.descriptor` in cluster ``scope``; ``TransferError`` otherwise.  Pure: a malformed
    descriptor never reaches the NIXL agent."""
    d = decode_descriptor(descriptor, NixlDescriptor, "NIXL", scope)
    return d.name, d.agent, {name: (r.address, r.length) for name, r in d.regions.items()}
