"""The faults the chaos bench (``bench/chaos.py``) injects into a serving pool, one kind a run: each is
:meth:`Fault.inject`, held ``hold_s``, then :meth:`Fault.end`; :meth:`Fault.outcome` says afterwards what it did.

- ``peer-stall``: a PoolNode's process SIGSTOPped, longer than a READ's deadline without a pin
  (``pool/client/peers.py``: ``UNPINNED_TIMEOUT_S``), then SIGCONT: the late-READ case;
- ``etcd-restart``: the pool's etcd killed, started again on the same ports and data at the end;
- ``byte-flip``: one byte flipped in every chunk a node holds in DRAM (its shared-memory segment file, behind its
  back): every read of one must fail its checksum and be recomputed;
- ``node-kill``: a PoolNode actor killed (its chunks and its lease gone with it), started again at the end (a warm
  restart where the pool keeps NVMe segments: it takes back what verifies);
- ``engine-kill``: one vLLM server SIGKILLed (its whole session), not started again.
"""

import os
import random
import signal
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.pool.client import PoolClient
from kvpool.pool.client.peers import UNPINNED_TIMEOUT_S, node_record
from kvpool.pool.config import PoolConfig
from kvpool.pool.node import start_pool
from kvpool.pool.protocol import NodeHandle, actor_name
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.process import ServerProcess

#: in the order the bench runs them: what leaves lasting damage last (a killed engine stays down; an engine whose
#: node's PoolNode was restarted keeps the dead actor's handle, so it saves nothing more: see ``outcome``)
KINDS = ("peer-stall", "etcd-restart", "byte-flip", "node-kill", "engine-kill")


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
    victim: Victim
    hold_s: float
    kind: str = "peer-stall"
    pid: int = 0

    def __post_init__(self) -> None:
        if self.hold_s <= UNPINNED_TIMEOUT_S:
            raise ConfigError(f"a stall must outlast a READ's deadline ({UNPINNED_TIMEOUT_S:g} s), got {self.hold_s:g}")

    def inject(self) -> None:
        with PoolClient(self.victim.pool) as client:
            record = node_record(client.cache, self.victim.node_id)
        if record is None:
            raise ConfigError(f"node {self.victim.node_id[:8]} has no record in the pool")
        self.pid = record.pid
        os.kill(self.pid, signal.SIGSTOP)

    def end(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def outcome(self) -> str:
        return f"PoolNode {self.victim.node_id[:8]} (pid {self.pid}) stopped {self.hold_s:g} s"


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
    victim: Victim
    hold_s: float = 0.0
    kind: str = "engine-kill"

    def inject(self) -> None:
        self.victim.engine.kill()

    def end(self) -> None:
        pass

    def outcome(self) -> str:
        return f"engine (pid {self.victim.engine.pid}) SIGKILLed, not restarted: the requests routed to it fail"


def fault(kind: str, victim: Victim, hold_s: float) -> Fault:
    """The fault of ``kind`` (one of ``KINDS``) on ``victim``."""
    made: dict[str, Any] = {
        "node-kill": NodeKill,
        "peer-stall": PeerStall,
        "etcd-restart": EtcdRestart,
        "byte-flip": ByteFlip,
        "engine-kill": EngineKill,
    }
    if kind not in made:
        raise ConfigError(f"fault kind: one of {', '.join(KINDS)}, got {kind!r}")
    found: Fault = made[kind](victim, hold_s if kind in ("node-kill", "peer-stall", "etcd-restart") else 0.0)
    return found
