"""The pool node on a client's own Ray node, bound: its actor, what it told of itself, its DRAM segment mapped; and
bound again once it was started again.

A same-node client writes into that node's DRAM and reads out of it through a mapping of its segment file, and calls
its actor.  A node started again on the Ray node (killed or crashed, then started by an operator or ``kvpool join``)
is a new actor in a new process with a new segment file.  Its node record names the new process
(``NodeRecord.pid``), and each call compares it with the process bound (``NodeInfo.pid``): on a difference the actor is
looked up again, asked for its info, and its segment mapped (a lookup, a call and a mapping, once per start).  Until
the watch cache shows the new record, calls fail or miss as they do with any dead node; the first one after uses the
new node.  The same check binds a node started on this Ray node after the client was made.

Earlier bindings stay open until the client closes: another thread may still be copying out of an old mapping (it
reads what the dead node left there, checked against the chunk's checksum as always).
"""

import logging
import threading

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import KvPoolError
from kvpool.metadata.cache import MetadataCache
from kvpool.pool.client.peers import node_record
from kvpool.pool.gds import DeviceIO
from kvpool.pool.protocol import NodeHandle, NodeHandles, NodeInfo
from kvpool.pool.segment import DramSegment, NvmeSegment

log = logging.getLogger(__name__)
RETRY_S = 1.0  #: a node that could not be bound is tried again after this long (a try is a lookup and a call)


class Binding:
    """The node as one client bound it: its actor (``handle``), what it told of itself (``info``), its mapped DRAM
    ``segment``; its NVMe segment file opened on first use, by host reads and device reads alike."""

    def __init__(self, handle: NodeHandle, info: NodeInfo, segment: DramSegment) -> None:
        self.handle, self.info, self.segment = handle, info, segment
        self._lock = threading.Lock()  #: guards the files opened on first use
        self._nvme: NvmeSegment | None = None
        self._io: DeviceIO | None = None

    def nvme(self) -> NvmeSegment | None:
        """The node's NVMe segment file (None: the node has none)."""
        with self._lock:
            if self._nvme is None and self.info.nvme_path:
                self._nvme = NvmeSegment.attach(self.info.nvme_path, self.info.nvme_capacity)
            return self._nvme

    def device_io(self) -> DeviceIO | None:
        """Reads from the NVMe segment file into tensors (None: the node has no NVMe segment)."""
        nvme = self.nvme()
        with self._lock:
            if self._io is None and nvme is not None:
                self._io = DeviceIO(nvme)
            return self._io

    def close(self) -> None:
        with self._lock:
            if self._io is not None:
                self._io.close()
            if self._nvme is not None:
                self._nvme.close()
        self.segment.close()


class LocalNode:
    """The pool node on Ray node ``node_id`` for one client: :meth:`current` is the binding a call uses."""

    def __init__(self, node_id: str, handles: NodeHandles, cache: MetadataCache, clock: Clock = SYSTEM_CLOCK) -> None:
        self.node_id, self.handles, self.cache, self.clock = node_id, handles, cache, clock
        self._lock = threading.Lock()  #: one thread binds at a time
        self._bound: Binding | None = None
        self._bindings: list[Binding] = []  #: every binding made, closed with the client
        self._tried: tuple[int, float] = (-1, 0.0)  #: the process last tried and failed, and when
        record = node_record(cache, node_id)
        with self._lock:
            self._bind(record.pid if record is not None else -1)
        if self._bound is None:
            log.info("no pool node on this Ray node (%s): every transfer goes to peers", node_id[:12])

    def current(self) -> Binding | None:
        """The binding to use for one call (None: no pool node here): the one held, or a new one when the node's
        record names another process than the one bound."""
        bound = self._bound
        record = node_record(self.cache, self.node_id)
        if record is None or (bound is not None and record.pid == bound.info.pid):
            return bound
        with self._lock:
            pid, at = self._tried
            if self._bound is bound and (record.pid != pid or self.clock.monotonic() - at >= RETRY_S):
                self._bind(record.pid)
            return self._bound

    def handle(self) -> NodeHandle | None:
        """The actor of the node bound now (None: no pool node here)."""
        bound = self.current()
        return bound.handle if bound is not None else None

    def _bind(self, pid: int) -> None:
        """Look the node's actor up, ask it for its info and map its segment (the lock held); ``pid``: the process
        its record names (-1: none), tried again only after :data:`RETRY_S` unless the record changes."""
        self._tried = (pid, self.clock.monotonic())
        try:
            handle = self.handles.renew(self.node_id)
            info = handle.info()
            if self._bound is not None and info.pid == self._bound.info.pid:
                return  # the record is older than the node bound
            segment = DramSegment.attach(info.dram_path, info.dram_capacity)
        except (KvPoolError, OSError) as exc:  # not there (yet), or gone again with its file
            if pid != -1:
                log.warning("the pool node on this Ray node cannot be bound (tried again in %g s): %s", RETRY_S, exc)
            return
        if self._bound is not None:
            log.info("the pool node on this Ray node was started again (process %d): bound anew", info.pid)
        self._bound = Binding(handle, info, segment)
        self._bindings.append(self._bound)

    def close(self) -> None:
        with self._lock:
            bindings, self._bindings, self._bound = self._bindings, [], None
        for binding in bindings:
            binding.close()
