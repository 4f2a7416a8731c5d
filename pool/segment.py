"""Storage segments: the byte ranges a pool node lends out.  Pure I/O, no allocation logic.

A :class:`DramSegment` is a file on tmpfs (``/dev/shm``) mapped ``MAP_SHARED``, so a client process on the
same node can :meth:`DramSegment.attach` the same file and read or write chunks without a copy.  A
:class:`NvmeSegment` is a preallocated file on a local disk, read and written with ``O_DIRECT`` where the
filesystem allows it.  Both reserve their whole capacity when created, so a segment that does not fit
fails at once with :class:`~kvpool.errors.PoolFull` instead of a ``SIGBUS`` or ``ENOSPC`` mid-transfer.
Neither knows who owns which range: the allocator hands out disjoint ranges.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import threading
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Annotated, Self

import numpy as np
from msgspec import Meta

from kvpool.core.config import checked, validated
from kvpool.core.procs import proc_stat
from kvpool.errors import ConfigError, PoolFull, SetupError
from kvpool.pool.buffers import byte_view

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from typing_extensions import Buffer

logger = logging.getLogger(__name__)

ALIGN = 4096  #: NVMe offsets and O_DIRECT transfers are multiples of this many bytes.
_Aligned = Annotated[int, Meta(multiple_of=ALIGN, description=f"a multiple of {ALIGN}")]
CHUNK = 8 << 20  #: Largest single O_DIRECT transfer; the bounce buffer's size.
_Capacity = Annotated[int, Meta(ge=1, description="a segment capacity in bytes > 0")]


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _create_file(directory: str, name: str | None, suffix: str, capacity: int, reserve: int) -> tuple[str, int]:
    """Create ``kvpool-<name>.<suffix>`` (never an existing one) with ``reserve`` bytes allocated on disk.

    Returns ``(path, fd)`` with ``fd`` open read/write.  On any failure the file is removed again.
    """
    path = os.path.join(directory, f"kvpool-{name or uuid.uuid4().hex}.{suffix}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, reserve)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            st = os.statvfs(directory)
            raise PoolFull(
                f"cannot reserve {capacity} bytes for segment {path}: {directory} has only "
                f"{st.f_bavail * st.f_frsize} bytes free ({os.strerror(e.errno)}); lower the segment capacity"
            ) from e
        raise
    return path, fd


class _Segment(ABC):
    """What both tiers share: a file of ``capacity`` usable bytes, unlinked on close only by its ``owner``."""

    def __init__(self, path: str, capacity: int, owner: bool) -> None:
        self.path = path
        self.capacity = capacity
        self.owner = owner

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` has run (then every read and write raises ``ConfigError``)."""

    def _check(self, offset: int, length: int) -> None:
        """``ConfigError`` if the segment is closed or ``[offset, offset + length)`` is not inside it."""
        if self.closed:
            raise ConfigError(f"segment {self.path} is closed")
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ConfigError(f"range [{offset}, {offset + length}) is outside segment [0, {self.capacity})")

    @abstractmethod
    def close(self) -> None:
        """Release the segment (each tier says what that means)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class DramSegment(_Segment):
    """A shared-memory file mapped read/write.

    Invariants: the mapping covers exactly ``[0, capacity)``; ``base_address`` stays valid until
    :meth:`close`; only the creator (``owner``) ever unlinks the file.  Views from :meth:`view` alias the
    mapping and must be released (``view.release()`` or dropped) before :meth:`close`, which otherwise raises
    ``BufferError`` and leaves the segment open and the file in place, so it can be retried.
    """

    def __init__(self, path: str, capacity: int, fd: int, owner: bool) -> None:
        super().__init__(path, capacity, owner)
        try:
            # MAP_POPULATE faults every page in now, not on each chunk's first touch (a slower first read)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm: mmap.mmap | None = mmap.mmap(fd, capacity, flags)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.base_address: int = ctypes.addressof(anchor)
        del anchor  # drop the export, or mmap.close() would refuse

    @classmethod
    @checked
    def create(cls, capacity: _Capacity, directory: str = "/dev/shm", name: str | None = None) -> Self:
        """Create and map a new segment file of ``capacity`` bytes, all reserved now (``PoolFull`` if not)."""
        path, fd = _create_file(directory, name, "seg", capacity, capacity)
        try:
            return cls(path, capacity, fd, owner=True)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, path: str, capacity: int) -> Self:
        """Map an existing segment file (a same-node client's view); never unlinks it."""
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        if not 0 < capacity <= size:
            os.close(fd)
            raise ConfigError(f"cannot attach {capacity} bytes of {path}: the file holds {size} bytes")
        return cls(path, capacity, fd, owner=False)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def _map(self, offset: int, length: int) -> mmap.mmap:
        self._check(offset, length)
        assert self._mm is not None  # _check: not closed
        return self._mm

    def view(self, offset: int, length: int) -> memoryview:
        """A zero-copy, writable view of ``[offset, offset+length)``; release it before :meth:`close`."""
        mm = self._map(offset, length)
        with memoryview(mm) as whole:
            return whole[offset : offset + length]

    def write(self, offset: int, data: Buffer) -> None:
        """Copy ``data`` (any C-contiguous buffer) to ``offset``."""
        with byte_view(data) as src:
            self._map(offset, src.nbytes)[offset : offset + src.nbytes] = src

    def read_into(self, offset: int, dest: Buffer) -> int:
        """Fill the writable buffer ``dest`` from ``offset``; returns the number of bytes copied."""
        with byte_view(dest, writable=True, field="dest") as dst:
            with memoryview(self._map(offset, dst.nbytes)) as whole:
                dst[:] = whole[offset : offset + dst.nbytes]
            return dst.nbytes

    def close(self) -> None:
        """Unmap, and unlink the file if this segment created it.  Idempotent.

        Raises ``BufferError`` (and changes nothing) while a view from :meth:`view` is still alive.
        """
        if self._mm is None:
            return
        try:
            self._mm.close()
        except BufferError as e:
            raise BufferError(f"segment {self.path} still has live views; release them before close()") from e
        self._mm = None
        if self.owner:
            os.unlink(self.path)


class NvmeSegment(_Segment):
    """A preallocated file on a local disk, accessed with ``O_DIRECT`` when :attr:`direct` is true.

    Invariants: offsets are multiples of :data:`ALIGN`; the file holds ``capacity`` rounded up to ``ALIGN``.
    In direct mode a write of ``n`` bytes at ``offset`` rewrites ``[offset, offset + round_up(n))``, the tail
    padded with zeros, so the allocator must give every chunk whole ``ALIGN`` blocks.  Direct I/O moves a
    page-aligned buffer of whole blocks (a mapped segment's range, say) as it is; any other buffer goes through
    a page-aligned bounce buffer of :data:`CHUNK` bytes per thread, so calls from several threads run at once
    (the kernel does the I/O without the GIL).  Buffered I/O reads and writes the caller's buffer directly.
    """

    def __init__(self, path: str, capacity: int, fd: int, direct: bool, owner: bool) -> None:
        super().__init__(path, capacity, owner)
        self.direct = direct
        self._fd: int | None = fd
        self._bounces: list[mmap.mmap] = []  #: every thread's bounce buffer, closed with the segment
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._fd is None

    @classmethod
    @checked
    def create(cls, capacity: _Capacity, directory: str, name: str | None = None, direct: bool | None = None) -> Self:
        """Create ``kvpool-<name>.nvme`` in ``directory``, reserve its space, and open it.

        ``direct=None`` uses ``O_DIRECT`` if the filesystem allows it, else buffered I/O with one warning;
        ``direct=True`` raises ``SetupError`` where it is refused; ``direct=False`` never tries it.
        """
        path, fd = _create_file(directory, name, "nvme", capacity, _round_up(capacity))
        try:
            return cls._opened(path, capacity, fd, direct, owner=True)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def reopen(cls, path: str, capacity: int, direct: bool | None = None) -> Self:
        """Open a segment file an earlier node left (see :mod:`kvpool.pool.node.journal`) read/write, as :meth:`create`
        would have; it must hold ``capacity`` bytes (rounded up to ``ALIGN``).  Closing it keeps the file."""
        fd = os.open(path, os.O_RDWR)
        if os.fstat(fd).st_size != _round_up(capacity):
            os.close(fd)
            raise ConfigError(f"{path} holds {os.path.getsize(path)} bytes, not a segment of {capacity}")
        return cls._opened(path, capacity, fd, direct, owner=False)

    @classmethod
    def _opened(cls, path: str, capacity: int, fd: int, direct: bool | None, owner: bool) -> Self:
        """The segment over ``fd`` (read/write, closed here on failure), reopened with ``O_DIRECT`` unless ``direct``
        is False or the filesystem refuses it (then: ``SetupError`` if ``direct`` is True, else buffered I/O and
        one warning)."""
        use_direct = False
        if direct is not False:
            try:
                direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL or direct:
                    os.close(fd)
                    if e.errno != errno.EINVAL:
                        raise
                    raise SetupError(f"direct=True but {os.path.dirname(path)} does not support O_DIRECT") from e
                logger.warning(
                    "%s does not support O_DIRECT; segment %s uses buffered I/O", os.path.dirname(path), path
                )
            else:
                os.close(fd)
                fd, use_direct = direct_fd, True
        return cls(path, capacity, fd, use_direct, owner)

    @classmethod
    def attach(cls, path: str, capacity: int) -> Self:
        """Open another process's segment file (a pool node's) read-only, to read chunks that node has pinned;
        ``O_DIRECT`` where the filesystem allows it.  Closing it never removes the file."""
        try:
            fd, direct = os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fd, direct = os.open(path, os.O_RDONLY), False
        return cls(path, capacity, fd, direct, owner=False)

    def fd_for(self, offset: int, length: int) -> int:
        """The file to read or write ``[offset, offset + length)`` through; ``ConfigError`` if the segment is closed,
        ``offset`` is not a multiple of :data:`ALIGN`, or the range is not inside the segment."""
        self._check(offset, length)
        if offset % ALIGN:  # only a misaligned offset pays for the declared check that words it
            validated(_Aligned, offset, "offset")
        assert self._fd is not None  # _check: not closed
        return self._fd

    def _bounce(self, buf: memoryview) -> memoryview | None:
        """A view of this thread's bounce buffer, to move ``buf`` through (None: ``buf`` moves as it is)."""
        if not self.direct or _aligned(buf):
            return None
        mm: mmap.mmap | None = getattr(self._local, "bounce", None)
        if mm is None:
            mm = self._local.bounce = mmap.mmap(-1, CHUNK)
            with self._lock:
                self._bounces.append(mm)
        return memoryview(mm)

    def write(self, offset: int, data: Buffer) -> None:
        """Write ``data`` (any C-contiguous buffer) at ``offset``."""
        with byte_view(data) as src:
            fd = self.fd_for(offset, src.nbytes)
            bounce = self._bounce(src)
            if bounce is None:
                _transfer(os.pwritev, fd, src, offset)
                return
            with bounce:
                for pos in range(0, src.nbytes, CHUNK):
                    n = min(CHUNK, src.nbytes - pos)
                    padded = _round_up(n)
                    bounce[:n] = src[pos : pos + n]
                    bounce[n:padded] = bytes(padded - n)
                    _transfer(os.pwritev, fd, bounce[:padded], offset + pos)

    def read_into(self, offset: int, dest: Buffer) -> int:
        """Fill the writable buffer ``dest`` from ``offset``; returns the number of bytes read."""
        with byte_view(dest, writable=True, field="dest") as dst:
            fd = self.fd_for(offset, dst.nbytes)
            bounce = self._bounce(dst)
            if bounce is None:
                _transfer(os.preadv, fd, dst, offset)
                return dst.nbytes
            with bounce:
                for pos in range(0, dst.nbytes, CHUNK):
                    n = min(CHUNK, dst.nbytes - pos)
                    _transfer(os.preadv, fd, bounce[: _round_up(n)], offset + pos)
                    dst[pos : pos + n] = bounce[:n]
            return dst.nbytes

    def read(self, offset: int, length: int) -> bytearray:
        """Read ``length`` bytes at ``offset`` into a new ``bytearray``."""
        out = bytearray(length)
        self.read_into(offset, out)
        return out

    def close(self, remove: bool | None = None) -> None:
        """Close the file; delete it if ``remove`` (default: if this segment created it).  Idempotent."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        with self._lock:
            for buf in self._bounces:
                with contextlib.suppress(BufferError):  # a thread is mid-transfer: freed when it is collected
                    buf.close()
            self._bounces.clear()
        if self.owner if remove is None else remove:
            os.unlink(self.path)


def _aligned(buf: memoryview) -> bool:
    """Whether O_DIRECT can move ``buf`` as it is: page-aligned, whole blocks."""
    return buf.nbytes % ALIGN == 0 and np.frombuffer(buf, np.uint8).ctypes.data % ALIGN == 0


def _transfer(op: Callable[[int, list[memoryview], int], int], fd: int, buf: memoryview, offset: int) -> None:
    """Run ``os.preadv``/``os.pwritev`` until all of ``buf`` is moved (they may stop short)."""
    done = 0
    while done < buf.nbytes:
        with buf[done:] as rest:
            moved = op(fd, [rest], offset + done)
        if moved == 0:
            raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done} of fd {fd}")
        done += moved


_SEGMENT_FILE = re.compile(r"^kvpool-(?:nvme-)?[0-9a-f]{16}-(\d+)(?:\.seg|\.nvme|-\w+)$")


def reap_stale_segments(*directories: str) -> None:
    """Remove segment files and NVMe temp dirs left by pool nodes that were killed (``ray.kill`` and
    crashes run no cleanup).  Their names carry the owner's pid; a live pid is left alone."""
    for directory in directories:
        for entry in os.scandir(directory):
            m = _SEGMENT_FILE.match(entry.name)
            if m is None or _alive(int(m[1])):
                continue
            logger.info("removing %s, left by dead pool node process %s", entry.path, m[1])
            if entry.is_dir():
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped by a parent that may never come) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    return fields is None or fields[0] != "Z"  # no /proc here: a pid that answers is alive
