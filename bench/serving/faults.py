"""The faults the chaos bench (``bench/chaos.py``) injects into a serving pool, one kind a run: each is
:meth:`Fault.inject`, held ``hold_s``, then :meth:`Fault.end`; :meth:`Fault.outcome` says afterwards what it did.

- ``peer-stall``: a PoolNode's process SIGSTOPped, longer than a READ's deadline without a pin
  (``pool/client/peers.py``: ``UNPINNED_TIMEOUT_S``), then SIGCONT: the late-READ case;
- ``slow-peer``: a PoolNode's process stopped and continued in turn (stopped :data:`SLOW_STOPPED_S` of every
  :data:`SLOW_PERIOD_S`): a peer several times slower at everything, its transfers and its calls (a slow network
  would need ``tc`` on a link the bench does not own);
- ``etcd-restart``: the pool's etcd killed, started again on the same ports and data at the end;
- ``byte-flip``: one byte flipped in every chunk a node holds in DRAM (its shared-memory segment file, behind its
  back): every read of one must fail its checksum and be recomputed;
- ``full-pool``: every node's DRAM taken by rooms the bench opens and never fills (as writers that hang would hold
  it), so nothing is left there to evict and every put is refused (``PoolFull``) until they are given back; what DRAM
  held moved to NVMe to make way (dropped where NVMe was full).  Hold it below ``reservation_ttl_s`` (30 s), after
  which a node reclaims an unfilled room;
- ``node-kill``: a PoolNode actor killed (its chunks and its lease gone with it), started again at the end (a warm
  restart where the pool keeps NVMe segments: it takes back what verifies);
- ``engine-kill``: one vLLM server SIGKILLed (its whole session), not started again.
"""

import os
import random
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from kvpool.core.types import Tier
from kvpool.errors import ConfigError, PoolFull
from kvpool.pool.client import PoolClient
from kvpool.pool.client.peers import UNPINNED_TIMEOUT_S, node_record
from kvpool.pool.config import PoolConfig
from kvpool.pool.node import start_pool
from kvpool.pool.protocol import NodeHandle, actor_name
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.process import ServerProcess

#: in the order the bench runs them: what leaves lasting damage last (a killed engine stays down; an engine whose
#: node's PoolNode was restarted keeps the dead actor's handle, so it saves nothing more: see ``outcome``)
KINDS = ("peer-stall", "slow-peer", "etcd-restart", "byte-flip", "full-pool", "node-kill", "engine-kill")
SLOW_PERIOD_S, SLOW_STOPPED_S = 0.2, 0.15  #: slow-peer: stopped this much of every period
#: full-pool: the rooms it opens, largest first (each size until the node refuses one), so that no gap is left
ROOM_SIZES = tuple(4 << 20 >> i for i in range(0, 11, 2))
Counters = dict[str, dict[str, float]]  #: engine URL -> ``name{label}`` -> count (``harness.fault_counts``)


def counted(before: Counters, after: Counters) -> dict[str, float]:
    """What the counters grew by from ``before`` to ``after``, summed over the engines (one not there before counts
    from 0; what an engine killed meanwhile had counted is lost with it)."""
    out: dict[str, float] = {}
    for engine, counts in after.items():
        for name, n in counts.items():
            if grew := n - before.get(engine, {}).get(name, 0.0):
                out[name] = out.get(name, 0.0) + grew
    return out


class Stoppable(Protocol):
    """A process a stall stops: a PoolNode's, a store's server."""

    def pid(self) -> int: ...

    def name(self) -> str: ...


class Fault(Protocol):
    kind: str
    hold_s: float  #: from the end of :meth:`inject` to :meth:`end`

    def inject(self) -> None: ...

    def end(self) -> None: ...

    def outcome(self) -> str:
        """What it did, once the run is over."""
        ...


@dataclass
class Victim:
    """What a fault may hit: the pool, one of its nodes (a Ray node id), the pool's etcd where this process runs
    it, and one engine's server."""

    pool: PoolConfig
    node_id: str
    etcd: EmbeddedEtcd | None
    engine: ServerProcess

    def node(self) -> NodeHandle:
        return NodeHandle(self.node_id, ray.get_actor(actor_name(self.node_id), namespace=self.pool.namespace))

    def name(self) -> str:
        return f"PoolNode {self.node_id[:8]}"

    def pid(self) -> int:
        """The process of the victim's PoolNode now, from its node record."""
        with PoolClient(self.pool) as client:
            record = node_record(client.cache, self.node_id)
        if record is None:
            raise ConfigError(f"node {self.node_id[:8]} has no record in the pool")
        return record.pid

    def corrupt_caught(self) -> int:
        """Replicas the pool's nodes dropped for failing their checksum, so far (every node that answers)."""
        with PoolClient(self.pool) as client:
            return sum(int(n.get("corrupt", 0)) for n in client.stats()["nodes"].values())


@dataclass
class NodeKill:
    victim: Victim
    hold_s: float
    kind: str = "node-kill"
    taken_back: str = ""

    def inject(self) -> None:
        ray.kill(self.victim.node().actor)

    def end(self) -> None:
        [handle] = start_pool(self.victim.pool, [self.victim.node_id]).values()
        self.taken_back = ray.get(handle.info.remote()).restart

    def outcome(self) -> str:
        warm = f"; took back {self.taken_back}" if self.taken_back else ""
        return f"PoolNode {self.victim.node_id[:8]} killed, started again after {self.hold_s:g} s{warm}"


@dataclass
class PeerStall:
    target: Stoppable
    hold_s: float
    kind: str = "peer-stall"
    pid: int = 0

    def __post_init__(self) -> None:
        if self.hold_s <= UNPINNED_TIMEOUT_S:
            raise ConfigError(f"a stall must outlast a READ's deadline ({UNPINNED_TIMEOUT_S:g} s), got {self.hold_s:g}")

    def inject(self) -> None:
        self.pid = self.target.pid()
        os.kill(self.pid, signal.SIGSTOP)

    def end(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def outcome(self) -> str:
        return f"{self.target.name()} (pid {self.pid}) stopped {self.hold_s:g} s"


@dataclass
class SlowPeer:
    target: Stoppable
    hold_s: float
    kind: str = "slow-peer"
    pid: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def inject(self) -> None:
        self.pid = self.target.pid()
        self._thread = threading.Thread(target=self._cycle, name=self.kind, daemon=True)
        self._thread.start()

    def _cycle(self) -> None:
        while not self._stop.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            self._stop.wait(SLOW_STOPPED_S)
            os.kill(self.pid, signal.SIGCONT)
            self._stop.wait(SLOW_PERIOD_S - SLOW_STOPPED_S)

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        os.kill(self.pid, signal.SIGCONT)

    def outcome(self) -> str:
        return (
            f"{self.target.name()} (pid {self.pid}) stopped {SLOW_STOPPED_S * 1000:.0f} ms of every "
            f"{SLOW_PERIOD_S * 1000:.0f} ms for {self.hold_s:g} s"
        )


@dataclass
class FullPool:
    victim: Victim
    hold_s: float
    kind: str = "full-pool"
    held: int = 0  #: bytes of DRAM the rooms took, over the nodes
    nodes: int = 0
    _rooms: list[tuple[NodeHandle, int]] = field(default_factory=list, repr=False)

    def inject(self) -> None:
        with PoolClient(self.victim.pool) as client:
            handles = [client.nodes[n.node_id] for n in client.cache.nodes()]
        for node in handles:
            self.nodes += 1
            for size in ROOM_SIZES:
                while True:
                    try:
                        room = node.prepare_store(size)
                    except PoolFull:
                        break
                    self._rooms.append((node, room.id))
                    self.held += room.length

    def end(self) -> None:
        for node, room_id in self._rooms:
            node.abort_store(room_id)

    def outcome(self) -> str:
        return (
            f"the DRAM of {self.nodes} nodes held by {len(self._rooms)} open rooms ({self.held / 2**20:.0f} MiB) for "
            f"{self.hold_s:g} s: puts refused, DRAM's chunks moved to NVMe (dropped where it was full)"
        )


@dataclass
class EtcdRestart:
    victim: Victim
    hold_s: float
    kind: str = "etcd-restart"

    def inject(self) -> None:
        if self.victim.etcd is None:
            raise ConfigError("the pool's etcd is not this process's to restart")
        self.victim.etcd.kill()

    def end(self) -> None:
        if self.victim.etcd is not None:
            self.victim.etcd.start()

    def outcome(self) -> str:
        return f"etcd killed, started again after {self.hold_s:g} s (same ports and data)"


@dataclass
class ByteFlip:
    victim: Victim
    hold_s: float = 0.0
    kind: str = "byte-flip"
    flipped: int = 0
    caught: int = 0  #: replicas dropped as corrupt during the run
    _before: int = 0
    _seed: int = field(default=7, repr=False)

    def inject(self) -> None:
        """One byte flipped at a random offset inside each DRAM chunk of the node, through its segment's file."""
        self._before = self.victim.corrupt_caught()
        path = self.victim.node().info().dram_path
        with PoolClient(self.victim.pool) as client:
            client.cache.sync()
            held = [p for _, ps in client.cache.chunks() for p in ps if p.node == self.victim.node_id]
        rng = random.Random(self._seed)
        with open(path, "r+b") as f:
            for p in (p for p in held if p.tier is Tier.DRAM):
                f.seek(p.offset + rng.randrange(p.stored))
                old = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([old ^ 0xFF]))
                self.flipped += 1

    def end(self) -> None:
        pass

    def outcome(self) -> str:
        self.caught = self.victim.corrupt_caught() - self._before
        return (
            f"{self.flipped} bytes flipped, one in each DRAM chunk of node {self.victim.node_id[:8]}; "
            f"{self.caught} replicas failed their checksum and were dropped (the others were not read again)"
        )


@dataclass
class EngineKill:
    engine: ServerProcess
    hold_s: float = 0.0
    kind: str = "engine-kill"

    def inject(self) -> None:
        self.engine.kill()

    def end(self) -> None:
        pass

    def outcome(self) -> str:
        return f"engine (pid {self.engine.pid}) SIGKILLed, not restarted: the requests routed to it fail"


@dataclass
class Mixed:
    """Faults of ``kinds`` one after another, each held ``each_s`` with ``gap_s`` between, in turn, for ``hold_s`` in
    all (the chaos bench's long run): the last one is ended when ``hold_s`` is up.  A fault that could not be injected
    or ended is counted by kind, its turn lasts ``each_s`` all the same, and the next goes on."""

    make: Callable[[str, float], Fault]  #: the fault of a kind, held so long (:func:`fault` on a victim)
    hold_s: float
    kinds: tuple[str, ...]
    each_s: float
    gap_s: float
    kind: str = "mixed"
    injected: dict[str, int] = field(default_factory=dict)  #: kind -> times injected and ended
    failed: dict[str, str] = field(default_factory=dict)  #: kind -> its last error
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def inject(self) -> None:
        self._thread = threading.Thread(target=self._cycle, name="mixed-faults", daemon=True)
        self._thread.start()

    def _cycle(self) -> None:
        turn = 0
        while not self._stop.is_set():
            kind = self.kinds[turn % len(self.kinds)]
            turn += 1
            try:
                one = self.make(kind, self.each_s)  # in the try: a hold too short for its kind is its error
                one.inject()
                try:
                    self._stop.wait(one.hold_s)
                finally:
                    one.end()
                self.injected[kind] = self.injected.get(kind, 0) + 1
            except Exception as exc:  # a fault that failed must not end the run: the others go on
                self.failed[kind] = f"{type(exc).__name__}: {exc}"[:200]
                self._stop.wait(self.each_s)  # its turn still lasts: failures in a row (gap 0) must not spin
            self._stop.wait(self.gap_s)

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def outcome(self) -> str:
        done = ", ".join(f"{n}x {k}" for k, n in self.injected.items()) or "none"
        failed = "".join(f"; {k} failed: {e}" for k, e in self.failed.items())
        return f"{done} over {self.hold_s:.0f} s ({self.each_s:g} s each, {self.gap_s:g} s between){failed}"


def fault(kind: str, victim: Victim, hold_s: float) -> Fault:
    """The fault of ``kind`` (one of ``KINDS``) on ``victim``."""
    if kind not in KINDS:
        raise ConfigError(f"fault kind: one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "engine-kill":
        return EngineKill(victim.engine)
    held: dict[str, Any] = {
        "node-kill": NodeKill,
        "peer-stall": PeerStall,
        "slow-peer": SlowPeer,
        "etcd-restart": EtcdRestart,
        "full-pool": FullPool,
    }
    found: Fault = held[kind](victim, hold_s) if kind in held else ByteFlip(victim)
    return found
