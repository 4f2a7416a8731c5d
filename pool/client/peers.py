"""A client's one-sided transfers with its peers (the pool nodes on other Ray nodes) over NIXL/UCX.

It owns the client's transport: started on the first transfer, a staging buffer registered once and grown on
demand, a connection per peer made from the transfer address in the peer's node record, and the caller's own
buffers registered so that READs land in them directly.

A READ that passes its deadline may still land later (``transport/nixl.py``): over TCP its bytes are written by this
process's own UCX worker whenever it is progressed again, whatever was done to the handle or the peer meanwhile
(measured: a cancelled READ, a dropped peer and a deregistered region all landed once the worker was polled).  An
engine recomputes a failed load into the same blocks at once, so those late bytes would overwrite what it computed: a
wrong token.  So such a transport is set aside for good, never progressed, closed or touched again (its staging
buffer kept with it), and a new one takes over, with the caller's buffers registered anew: the READ can never land,
and the caller's memory is free as soon as the read returns.  Costs: a NIXL agent (and its staging) a timed-out READ,
and reconnecting to the peers.  Over RDMA a late READ is written by the NIC with no progress at all; that path has no
RDMA NIC here to be checked on.
"""

import ctypes
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvpool.core.types import NodeRecord, Tier
from kvpool.errors import NodeUnreachable, TransferError, TransferInFlight
from kvpool.metadata.cache import MetadataCache
from kvpool.pool.buffers import byte_view
from kvpool.pool.chunks import SEGMENT_NAMES
from kvpool.transport.base import Op
from kvpool.transport.nixl import NixlTransport

log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  #: transfers through the staging buffer move at most this much per round
TRANSFER_TIMEOUT_S = 30.0
#: a READ with no pin (at a placement's offset) gives up after this plus a second per 100 MB: its failure costs only
#: the pinned read after it, whose call finds a dead holder at once, where the transport would wait for it
UNPINNED_TIMEOUT_S = 2.0
SUSPECT_S = 30.0  #: a peer a transfer failed with is read the pinned way only, for this long


def rounds(sizes: Sequence[int], budget: int) -> Iterator[slice]:
    """Consecutive slices of ``sizes`` whose sum stays within ``budget`` (a slice holds at least one item):
    the rounds of a batch that must fit a staging buffer, or the room a node can reserve at once."""
    start = 0
    while start < len(sizes):
        end, total = start, 0
        while end < len(sizes) and (end == start or total + sizes[end] <= budget):
            total += sizes[end]
            end += 1
        yield slice(start, end)
        start = end


def node_record(cache: MetadataCache, node_id: str) -> NodeRecord | None:
    """The live record of ``node_id`` in the watch cache (None: it is not in the pool)."""
    return next((n for n in cache.nodes() if n.node_id == node_id), None)


def _buffer_region(buffer: Any) -> tuple[str, int, int]:
    """``(region name, address, nbytes)`` of a caller's writable buffer."""
    view = byte_view(buffer, writable=True, field="buffer")
    address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return f"user-{address:x}-{view.nbytes}", address, view.nbytes


class Peers:
    """``fault(kind)`` is told of each transfer that went wrong, by ``kvpool.pool.metrics.TRANSFER_FAULTS``."""

    def __init__(
        self,
        cache: MetadataCache,
        scope: str,
        timeout_s: float = TRANSFER_TIMEOUT_S,
        fault: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self.cache, self.scope, self.timeout_s, self.fault = cache, scope, timeout_s, fault
        self._transport: NixlTransport | None = None
        self._stage: np.ndarray | None = None
        self._connected: dict[str, str] = {}  #: node id -> the transport's peer name
        self._descriptors: dict[str, bytes] = {}  #: node id -> the descriptor it was connected from
        self._registered: dict[str, tuple[int, int]] = {}  #: caller buffers: region name -> (address, nbytes)
        self._failed: dict[str, float] = {}  #: node id -> when a transfer with it last failed
        self._set_aside = 0  #: transports set aside (the module's docstring)

    @property
    def transport(self) -> NixlTransport:
        if self._transport is None:
            self._transport = NixlTransport(scope=self.scope)
            for name, (address, nbytes) in self._registered.items():
                self._transport.register(name, address, nbytes)
        return self._transport

    @property
    def set_aside(self) -> int:
        """Transports set aside because a READ of theirs passed its deadline (the module's docstring)."""
        return self._set_aside

    @property
    def registrations(self) -> int:
        """Memory regions registered with the transport (staging, caller buffers)."""
        return 0 if self._transport is None else self._transport.registrations

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- buffers ---------------------------------------------------------------------------------------

    def register(self, buffer: Any) -> None:
        name, address, nbytes = _buffer_region(buffer)
        if name not in self._registered:
            self.transport.register(name, address, nbytes)
            self._registered[name] = (address, nbytes)

    def unregister(self, buffer: Any) -> None:
        name, _, _ = _buffer_region(buffer)
        if self._registered.pop(name, None) is not None:
            self.transport.deregister(name)

    def registered_addresses(self, pieces: list[memoryview]) -> list[int] | None:
        """The addresses of ``pieces`` if every one lies inside a registered buffer (None if any does not)."""
        out = []
        for piece in pieces:
            address = np.frombuffer(piece, dtype=np.uint8).ctypes.data
            if not any(
                start <= address and address + piece.nbytes <= start + n for start, n in self._registered.values()
            ):
                return None
            out.append(int(address))
        return out

    def staging(self, nbytes: int) -> np.ndarray:
        """A buffer registered with the transport, at least ``nbytes`` long (grown on demand)."""
        if self._stage is None or self._stage.nbytes < nbytes:
            if self._stage is not None:
                self.transport.deregister("staging")
            self._stage = np.empty(max(nbytes, 16 << 20), dtype=np.uint8)
            self.transport.register("staging", self._stage.ctypes.data, self._stage.nbytes)
        return self._stage

    def connect_all(self, here: str) -> int:
        """Start the transport, register a staging buffer, connect to every live pool node but ``here`` and READ a
        few bytes of its DRAM segment (the transport wires a connection up on its first transfer) now, so that a
        first transfer does not pay for them (an engine does this at start); the peers connected.  A node that
        cannot be reached is left for a later transfer to try again."""
        stage = self.staging(0)
        wire_up = [Op(SEGMENT_NAMES[Tier.DRAM], 0, stage.ctypes.data, 64)]  #: the bytes read are not used
        return sum(self.read(n.node_id, wire_up) for n in self.cache.nodes() if n.node_id != here)

    # -- transfers -------------------------------------------------------------------------------------

    def _peer(self, node_id: str, pid: int = 0) -> str:
        """The transport peer of a pool node, connected from the descriptor in its node record; connected anew when
        the record's descriptor changed (the node was started again on its Ray node: a new agent).  ``pid``: the node
        process a write's room came from (0: any), refused (``NodeUnreachable``) unless the record still names it: the
        node started again since is another agent, whose DRAM may hold its own chunks at the room's offsets."""
        record = node_record(self.cache, node_id) if pid else None  # one record for the check and the connection
        if pid and record is None:
            raise NodeUnreachable(f"pool node {node_id[:12]} left the pool since its room was opened: put again")
        if record is not None and record.pid != pid:
            self.fault("restarted_peer")
            raise NodeUnreachable(
                f"pool node {node_id[:12]} was started again since its room was opened (process {pid}, now "
                f"{record.pid}): put again"
            )
        if node_id in self._connected and node_id in self._descriptors:
            record = record or node_record(self.cache, node_id)
            if record is not None and record.address and record.address != self._descriptors[node_id]:
                self.transport.disconnect(self._connected.pop(node_id))
        if node_id not in self._connected:
            record = record or node_record(self.cache, node_id)
            if record is None or not record.address:
                raise NodeUnreachable(f"pool node {node_id[:12]} is gone or publishes no transfer address")
            try:
                self._connected[node_id] = self.transport.connect(record.address)
            except TransferError as exc:
                raise NodeUnreachable(f"pool node {node_id[:12]} cannot be reached: {exc}") from exc
            self._descriptors[node_id] = record.address
        return self._connected[node_id]

    def write(self, node_id: str, ops: list[Op], pid: int = 0) -> None:
        """One batched one-sided WRITE to ``node_id``, into a room its process ``pid`` opened (0: not known); refused
        (``NodeUnreachable``) once the node's record names another process (:meth:`_peer`).  ``TransferError`` if it
        failed (one past its deadline sets the transport aside, as a READ's does: its source, the staging buffer, is
        refilled by the next write)."""
        peer = self._peer(node_id, pid)
        try:
            self.transport.write(peer, ops, timeout_s=self.timeout_s)
        except TransferError as exc:
            self.fault("write_failed")
            if isinstance(exc, TransferInFlight):
                self._connected.pop(node_id, None)
                self._set_transport_aside()
            raise

    def read(self, node_id: str, ops: list[Op], pinned: bool = True) -> bool:
        """One batched one-sided READ from ``node_id``; False (logged) if the transfer failed.  A READ of chunks not
        pinned on the holder (``pinned`` False) has a short deadline (:data:`UNPINNED_TIMEOUT_S`).  One that passed
        its deadline and may still land (:class:`TransferInFlight`) sets the transport aside (the module's
        docstring): it cannot land, and the caller may fill or reuse that memory at once."""
        timeout_s = self.timeout_s if pinned else UNPINNED_TIMEOUT_S + sum(o.length for o in ops) / 1e8
        try:
            self.transport.read(self._peer(node_id), ops, timeout_s=timeout_s)
        except TransferError as exc:  # NodeUnreachable included
            log.warning("reading from %s failed: %s", node_id[:12], exc)
            self.fault("read_failed")
            self._failed[node_id] = time.monotonic()
            self._connected.pop(node_id, None)
            if isinstance(exc, TransferInFlight):
                self._set_transport_aside()
            return False
        self._failed.pop(node_id, None)
        return True

    def _set_transport_aside(self) -> None:
        """Keep the transport and its staging buffer from ever being progressed, closed or freed; the next transfer
        starts a new one (the module's docstring)."""
        assert self._transport is not None
        for kept in (self._transport, self._stage):  # a reference never dropped: NIXL's agent, freed with a
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # READ in flight, crashes the process
        self._transport, self._stage = None, None
        self._connected.clear()
        self._set_aside += 1
        self.fault("late")
        log.warning(
            "a READ passed its deadline and may still land: its transport is set aside for good (%d so far), a new "
            "one takes over",
            self._set_aside,
        )

    def trusted(self, node_id: str) -> bool:
        """Whether no transfer with ``node_id`` failed in the last :data:`SUSPECT_S` (else: read it pinned only)."""
        return time.monotonic() - self._failed.get(node_id, -SUSPECT_S) >= SUSPECT_S
