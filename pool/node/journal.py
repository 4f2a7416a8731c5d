"""A node's NVMe chunks kept across restarts: its segment file and a journal of what the segment holds.

A node whose NVMe directory is configured (``PoolConfig.nvme_dir``: what ``kvpool join`` and cluster.yaml give every
node) with ``warm_restart`` on names its segment after the cluster and its own address, not its process —
``kvpool-<cluster>@<ip>.nvme`` — and keeps beside it ``kvpool-<cluster>@<ip>.journal``: one record per chunk that
came to NVMe (``put``: key, offset, sizes, checksum, codec, tensor format, tenant, cache identity fingerprint) or left
it (``gone``: key), appended when the node publishes the change, before etcd shows it.  The node that starts next on
that host and address (its actor, or its whole Ray node, died; or the pool was stopped) replays the journal, reads
every chunk it names and checks the checksum the record holds, and takes back those that verify: they are its chunks
again and are published as its placements.  Those that fail (bytes overwritten by a later chunk whose record never
made it, bits rotted on disk) are dropped with a ``corrupt`` tombstone, never served.  Then the journal is rewritten
with only what was taken back.

Why no fsync per record is needed: a record is only ever trusted together with the checksum of the bytes it names,
so a record that outlived its bytes (or bytes their record) costs one chunk, never serves a wrong one.  A record torn
by a crash mid-append fails its own crc and ends the replay there.  Two records that both stand and name overlapping
ranges (space reused before the ``gone`` of its previous chunk was written): the newer wins.  A host crash may lose
the last records the kernel had not written back: those chunks are simply not recovered.

Record: ``u32 length | u32 crc32c(payload) | payload`` (msgpack), little-endian.  The first record is a header
naming the format and the segment's capacity; a segment of another capacity (the node's config changed) is not
taken back: a fresh one replaces it.

One node at a time: a node holds ``kvpool-<cluster>@<ip>.lock`` (``flock``) while it uses the pair; another one
waits ``LOCK_WAIT_S`` for it to exit (a dying actor), then gets ``ConfigError``.
"""

import contextlib
import fcntl
import logging
import os
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import msgpack

from kvpool.core.types import Tier
from kvpool.errors import ConfigError, KvPoolError, SetupError
from kvpool.pool.chunks import Change, ChangeKind, Origin, StoredChunk, checksum, shared_origin, short
from kvpool.pool.node.allocator import OffsetAllocator
from kvpool.pool.node.moves import read_stored
from kvpool.pool.segment import ALIGN, NvmeSegment
from kvpool.pool.tiers.codecs import TensorFormat

if TYPE_CHECKING:
    from kvpool.pool.node.store import ChunkStore

log = logging.getLogger(__name__)
FORMAT = "kvpool-nvme-journal/1"
LOCK_WAIT_S = 15.0  #: how long a node waits for the one before it on the same files to exit
COMPACT_AFTER = 4  #: rewrite the journal once it holds this many records per chunk on NVMe ...
COMPACT_MIN = 4096  #: ... and at least this many
_FRAME = struct.Struct("<II")


def segment_name(cluster: str, ip: str) -> str:
    """The name (``kvpool-<name>.nvme``) of the segment a node at ``ip`` keeps for ``cluster``."""
    return f"{cluster}@{ip.replace(':', '_')}"


@dataclass(frozen=True)
class Recovery:
    """What a node found of its predecessor's NVMe chunks."""

    adopted: list[StoredChunk]  #: verified: this node's chunks again, oldest first
    dropped: list[StoredChunk]  #: named by the journal but their bytes did not verify (or overlapped newer ones)
    seconds: float  #: replaying, reading and checking
    bytes_read: int

    def figures(self) -> dict[str, float]:
        return {
            "adopted": len(self.adopted),
            "dropped": len(self.dropped),
            "bytes": self.bytes_read,
            "seconds": self.seconds,
        }

    def summary(self) -> str:
        """One line for a person ("" when there was nothing to take back)."""
        if not self.adopted and not self.dropped:
            return ""
        size = sum(c.stored for c in self.adopted)
        return (
            f"took back {len(self.adopted)} NVMe chunks ({size / 2**20:.1f} MiB) in {self.seconds:.2f} s; "
            f"{len(self.dropped)} did not verify"
        )


class NvmeJournal:
    """The journal of one persistent NVMe segment; :meth:`open` returns both, and what the journal names."""

    def __init__(self, path: str, lock_fd: int, capacity: int) -> None:
        self.path, self.capacity = path, capacity
        self._lock_fd = lock_fd
        self._fd: int | None = None
        self._held: dict[bytes, StoredChunk] = {}  #: what the records standing now name: the rewrite's content
        self._records = 0

    @classmethod
    def open(cls, directory: str, name: str, capacity: int) -> tuple[NvmeSegment, "NvmeJournal", list[StoredChunk]]:
        """The segment ``kvpool-<name>.nvme`` in ``directory`` (an earlier node's, or a new one of ``capacity``
        bytes), its journal, and the chunks the journal names (unverified: see :func:`recover`), oldest first.
        The journal records nothing until :meth:`rewrite` has started it afresh with the chunks taken back."""
        base = os.path.join(directory, f"kvpool-{name}")
        journal = cls(f"{base}.journal", _lock(f"{base}.lock"), capacity)
        try:
            named = journal._replay()
            segment = None
            if named is not None and os.path.exists(f"{base}.nvme"):
                try:
                    segment = NvmeSegment.reopen(f"{base}.nvme", capacity)
                except (ConfigError, SetupError) as exc:
                    log.warning("not taking back %s: %s", base, exc)
            if segment is None:
                named = []
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{base}.nvme")
                segment = NvmeSegment.create(capacity, directory, name=name)
                segment.owner = False  # the file outlives this node: that is its point
            return segment, journal, named or []
        except BaseException:
            journal.close()
            raise

    def _replay(self) -> list[StoredChunk] | None:
        """The chunks the journal's records leave standing, oldest first; None if there is no journal for a segment of
        this capacity."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        records = _records(data)
        header = next(records, None)
        if header != [FORMAT, self.capacity]:
            log.warning("%s is for another segment (%s); starting a fresh one", self.path, header)
            return None
        held: dict[bytes, StoredChunk] = {}
        for record in records:
            try:
                if record[0] == "put":
                    chunk = _chunk(record)
                    held.pop(chunk.key, None)  # its newest put makes it the newest chunk
                    held[chunk.key] = chunk
                elif record[0] == "gone":
                    held.pop(record[1], None)
            except (ValueError, TypeError, IndexError, KvPoolError) as exc:  # written by no kvpool: stop trusting
                log.warning("%s holds a malformed record (%s): replayed up to there", self.path, exc)
                break
        return list(held.values())

    def record(self, changes: Iterable[Change]) -> None:
        """Append what ``changes`` did to the NVMe tier, in order (one write); compact when the journal has grown."""
        out = []
        for change in changes:
            chunk = change.chunk
            if chunk.tier is Tier.NVME and change.kind is not ChangeKind.DROPPED:
                if self._held.get(chunk.key) == chunk:
                    continue  # recorded already (a chunk taken back at start)
                self._held.pop(chunk.key, None)
                self._held[chunk.key] = chunk
                out.append(_frame(_put(chunk)))
            elif self._held.pop(chunk.key, None) is not None:  # dropped from NVMe, or promoted off it
                out.append(_frame(["gone", chunk.key]))
        if not out or self._fd is None:
            return
        try:
            if self._records + len(out) > max(COMPACT_AFTER * len(self._held), COMPACT_MIN):
                self.rewrite(list(self._held.values()))
                return
            os.write(self._fd, b"".join(out))
            self._records += len(out)
        except OSError as exc:  # the pool goes on (the changes still reach etcd); only the next warm restart is lost
            self._give_up(exc)

    def _give_up(self, exc: OSError) -> None:
        """Stop journaling and remove the journal: a node started on this segment later takes nothing back."""
        log.warning("NVMe journal %s failed (%s): journaling stopped, the next restart starts empty", self.path, exc)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def rewrite(self, chunks: Sequence[StoredChunk]) -> None:
        """Replace the journal by one naming just ``chunks`` (written aside, synced, renamed over it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._held = {c.key: c for c in chunks}
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(_frame(r) for r in [[FORMAT, self.capacity], *map(_put, chunks)]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._records = len(chunks)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        """Sync and close the journal, then let another node have the files.  Idempotent."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1


def recover(segment: NvmeSegment, named: Sequence[StoredChunk], io: Executor) -> Recovery:
    """Which of ``named`` (oldest first) may be taken back: inside the segment, not overlapping a newer one, and
    whose stored bytes match their checksum (read ``io``'s threads at a time)."""
    began = time.monotonic()
    space = OffsetAllocator(segment.capacity, ALIGN)
    placed: list[StoredChunk] = []
    dropped: list[StoredChunk] = []
    for chunk in reversed(named):  # newest first: it wins a range two records claim
        try:
            space.claim(chunk.offset, chunk.stored)
        except ConfigError:
            dropped.append(chunk)
            continue
        placed.append(chunk)
    placed.reverse()
    intact = list(io.map(lambda c: checksum(read_stored(segment, c.offset, c.stored)) == c.checksum, placed))
    adopted = [c for c, ok in zip(placed, intact, strict=True) if ok]
    dropped += [c for c, ok in zip(placed, intact, strict=True) if not ok]
    for chunk in dropped:
        log.warning("not taking back chunk %s from %s: its bytes do not verify", short(chunk.key), segment.path)
    return Recovery(adopted, dropped, time.monotonic() - began, sum(c.stored for c in placed))


def take_back(
    store: "ChunkStore", journal: NvmeJournal, segment: NvmeSegment, named: Sequence[StoredChunk], io: Executor
) -> Recovery:
    """Have ``store`` adopt the chunks ``named`` by the journal of an earlier node on ``segment`` that verify
    (:func:`recover`); the journal starts afresh with them."""
    recovery = recover(segment, named, io)
    store.adopt(recovery.adopted, recovery.dropped)
    journal.rewrite(recovery.adopted)
    store.counters.update(recovered=len(recovery.adopted), recovery_dropped=len(recovery.dropped))
    if named:
        log.info("pool node on %s: %s", segment.path, recovery.summary())
    return recovery


def _lock(path: str) -> int:
    """``path`` opened and ``flock``-ed (waiting ``LOCK_WAIT_S`` for a holder to exit), holding our pid."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise SetupError(
                    f"{path} is held by another live pool node (pid {holder}): two nodes cannot share one NVMe "
                    "segment; give each its own --nvme-dir, or stop the other first"
                ) from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _put(chunk: StoredChunk) -> list[Any]:
    fmt, origin = chunk.fmt, chunk.origin
    return [
        "put",
        chunk.key,
        chunk.offset,
        chunk.stored,
        chunk.size,
        chunk.checksum,
        chunk.codec,
        None if fmt is None else [fmt.dtype, list(fmt.shape)],
        origin.tenant,
        origin.identity,
    ]


def _chunk(record: list[Any]) -> StoredChunk:
    """The chunk a ``put`` record names (one written before records carried the cache identity: with none)."""
    _, key, offset, stored, size, crc, codec, fmt, tenant, *identity = record
    if not (isinstance(key, bytes) and all(isinstance(v, int) for v in (offset, stored, size, crc))) or identity[1:]:
        raise TypeError(f"not a put record: {record!r:.80}")
    tensor = None if fmt is None else TensorFormat(fmt[0], tuple(fmt[1]))
    origin = _origin(tenant, *identity)
    return StoredChunk(key, Tier.NVME, offset, stored, size, crc, str(codec), tensor, origin=origin)


@lru_cache(maxsize=4096)
def _origin(tenant: str, identity: str = "") -> Origin:
    """The origin a put record names, made (and checked) once for all its chunks, one object shared by them."""
    return shared_origin(Origin(tenant, identity))


def _frame(record: list[Any]) -> bytes:
    payload = msgpack.packb(record, use_bin_type=True)
    return _FRAME.pack(len(payload), checksum(payload)) + payload


def _records(data: bytes) -> Iterator[list[Any]]:
    """The records of a journal's bytes, up to the first torn or malformed one."""
    at = 0
    while at + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, at)
        payload = data[at + _FRAME.size : at + _FRAME.size + length]
        if len(payload) < length or checksum(payload) != crc:
            log.warning("journal ends in a torn record at byte %d (a crash mid-append): replayed up to there", at)
            return
        try:
            record = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.UnpackException):
            return
        if not isinstance(record, list) or not record:
            return
        yield record
        at += _FRAME.size + length
