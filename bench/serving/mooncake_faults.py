"""The chaos bench's faults on Mooncake Store (``bench/chaos.py --layer mooncake``): the kinds of ``faults.py`` that have
a counterpart in a store made of a master and the standalone clients that hold its segments
(``bench/serving/mooncake.py``), each on the first holder or the master:

- ``store-stall``: the holder SIGSTOPped for the hold, then SIGCONT (kvpool's peer-stall);
- ``store-slow``: the holder stopped and continued in turn (slow-peer);
- ``byte-flip``: one byte flipped at a random offset in every :data:`FLIP_EVERY` bytes of the holder's segment (about
  kvpool's density at toy size, where its byte-flip hits each 1 MiB chunk once), written through ``/proc/PID/mem``:
  the segment is memory of the holder's own, not a file.  Mooncake keeps no checksum, so what is read of it is served;
- ``master-kill``: ``mooncake_master`` SIGKILLed, started again at the end on the same ports (etcd-restart's
  counterpart, and more: the master alone knows where every key is, and keeps it in memory);
- ``store-kill``: the holder SIGKILLed, started again at the end with a segment of the same size (node-kill; it
  comes back empty);
- ``engine-kill``: one vLLM server SIGKILLed, not started again (as for kvpool).

kvpool's full-pool has none: the bench cannot hold a Mooncake segment's space without filling it.
"""

import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.bench.serving.faults import EngineKill, Fault, PeerStall, SlowPeer
from kvpool.bench.serving.layers import Server
from kvpool.errors import ConfigError, WorkerUnavailable
from kvpool.servers.process import ServerProcess

KINDS = ("store-stall", "store-slow", "byte-flip", "master-kill", "store-kill", "engine-kill")
MASTER, HOLDER = "mooncake_master", "mooncake_client 0"  #: the servers hit, by their names in ``Layer.servers``
FLIP_EVERY = 1 << 20  #: byte-flip: one byte in every so many of the segment
RESTART_S = 120.0  #: a killed server started again and serving


@dataclass
class StoreVictim:
    """What a fault may hit: the store's servers (``Layer.servers``) and one engine's server."""

    servers: dict[str, Server]
    engine: ServerProcess
    segment_bytes: int  #: each holder's segment

    def server(self, name: str) -> Server:
        if name not in self.servers:
            raise ConfigError(f"the layer runs no {name} of its own (it has {', '.join(self.servers) or 'none'})")
        return self.servers[name]


@dataclass
class Holder:
    """The holder as the target of a stall (:class:`faults.Stoppable`)."""

    victim: StoreVictim

    def pid(self) -> int:
        process = self.victim.server(HOLDER).process
        if process.pid is None or not process.running():
            raise WorkerUnavailable(f"{HOLDER} is not running")
        return process.pid

    def name(self) -> str:
        return HOLDER


@dataclass
class Restart:
    server: Server
    hold_s: float
    kind: str

    def inject(self) -> None:
        self.server.process.kill()

    def end(self) -> None:
        self.server.process.start(self.server.ready, RESTART_S, WorkerUnavailable, poll_s=0.2)

    def outcome(self) -> str:
        return f"{self.server.process.name} SIGKILLed, started again after {self.hold_s:g} s (empty)"


@dataclass
class SegmentFlip:
    victim: StoreVictim
    hold_s: float = 0.0
    kind: str = "byte-flip"
    flipped: int = 0
    on_data: int = 0  #: of them, bytes that were not 0 (memory never written reads 0: these are likelier data)
    mapping: str = ""  #: the holder's mapping taken for its segment
    _seed: int = field(default=7, repr=False)

    def inject(self) -> None:
        pid = Holder(self.victim).pid()
        start, end = segment_mapping(pid, self.victim.segment_bytes)
        self.mapping = f"{(end - start) >> 20} MiB at {start:#x}"
        rng = random.Random(self._seed)
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            for block in range(start, end - FLIP_EVERY + 1, FLIP_EVERY):
                at = block + rng.randrange(FLIP_EVERY)
                old = os.pread(mem.fileno(), 1, at)[0]
                os.pwrite(mem.fileno(), bytes([old ^ 0xFF]), at)
                self.flipped += 1
                self.on_data += old != 0

    def end(self) -> None:
        pass

    def outcome(self) -> str:
        return (
            f"{self.flipped} bytes flipped in {HOLDER}'s segment ({self.mapping}), one in every {FLIP_EVERY >> 20} MiB, "
            f"{self.on_data} of them not 0 before (written data); Mooncake keeps no checksum to catch them"
        )


def segment_mapping(pid: int, size: int) -> tuple[int, int]:
    """The start and end of process ``pid``'s writable anonymous mapping (private, or shared as ``/dev/zero`` or a
    memfd) that holds a ``size``-byte segment: the smallest at least that large (``WorkerUnavailable`` if none is)."""
    found = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) rw\S+ \S+ \S+ \d+\s*(.*)$", line)
        if m and re.fullmatch(r"|\[heap\]|/dev/zero.*|/memfd:.*", m.group(3)):
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            if end - start >= size:
                found.append((end - start, start, end))
    if not found:
        raise WorkerUnavailable(f"process {pid} maps no writable anonymous region of {size} bytes or more")
    _, start, end = min(found)
    return start, end


def fault(kind: str, victim: StoreVictim, hold_s: float) -> Fault:
    """The fault of ``kind`` (one of ``KINDS``) on ``victim``."""
    if kind not in KINDS:
        raise ConfigError(f"fault kind for Mooncake Store: one of {', '.join(KINDS)}, got {kind!r}")
    made: dict[str, Callable[[], Fault]] = {
        "store-stall": lambda: PeerStall(Holder(victim), hold_s, kind),
        "store-slow": lambda: SlowPeer(Holder(victim), hold_s, kind),
        "byte-flip": lambda: SegmentFlip(victim),
        "master-kill": lambda: Restart(victim.server(MASTER), hold_s, kind),
        "store-kill": lambda: Restart(victim.server(HOLDER), hold_s, kind),
        "engine-kill": lambda: EngineKill(victim.engine),
    }
    return made[kind]()
