"""``ShmTransport``: the same-node path.  A peer's regions are shared-memory files; the reader maps them
and copies with ``memmove``, so a transfer is one memcpy with no agent, no socket and no registration.

A region is served when its address range lies in a ``MAP_SHARED`` mapping of a file (a pool node's
DRAM segment): ``register`` finds the file and offset in ``/proc/self/maps``.  Other local memory can
be the local end of a transfer; registering it is accepted and serves nothing.  Notifications travel as datagrams on an
abstract Unix socket per transport.  Only peers on the same host can connect.
"""

import ctypes
import mmap
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvpool.errors import ConfigError, TransferError
from kvpool.transport.base import Op, ShmDescriptor, ShmRegion, Transport, decode_descriptor, pop_notification

_PAGE = mmap.PAGESIZE


def file_backing(address: int, length: int) -> tuple[str, int]:
    """``(path, file offset)`` of the shared file mapping that holds ``[address, address+length)``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address and address + length <= end and fields[1][3] == "s" and len(fields) == 6:
                return fields[5].strip(), int(fields[2], 16) + address - start
    raise ConfigError(f"[{address:#x}, +{length}) is not inside a shared file mapping; ShmTransport serves only those")


def parse_descriptor(descriptor: bytes, scope: str) -> ShmDescriptor:
    """A descriptor made by :meth:`ShmTransport.descriptor` in cluster ``scope``; ``TransferError`` saying what
    is wrong otherwise.  Pure: it opens no file; :meth:`ShmTransport.connect` maps the regions afterwards."""
    return decode_descriptor(descriptor, ShmDescriptor, "shared-memory", scope)


@dataclass
class _Peer:
    pid: int
    socket_name: bytes
    maps: dict[str, tuple[mmap.mmap, int, int]]  #: region → (mapping, delta to the region's start, length)


class ShmTransport(Transport):
    def __init__(self, name: str | None = None, *, scope: str = "") -> None:
        self.name = name or f"kvpool-shm-{uuid.uuid4().hex[:12]}"
        self.scope = scope
        self._regions: dict[str, tuple[str, int, int]] = {}  #: name → (path, file offset, length)
        self._local_only: set[str] = set()
        self._peers: dict[str, _Peer] = {}
        self._sock_name = b"\0" + self.name.encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._sock_name)
        self._pending: list[tuple[str, bytes]] = []

    def register(self, name: str, address: int, length: int) -> None:
        """Serve a region backed by a shared file; other memory is only ever a local end, which needs no
        registration here (accepted, so callers treat every transport alike)."""
        if name in self._regions or name in self._local_only:
            raise ConfigError(f"region {name!r} is registered already")
        try:
            path, offset = file_backing(address, length)
        except ValueError:
            self._local_only.add(name)
            return
        self._regions[name] = (path, offset, length)

    def deregister(self, name: str) -> None:
        if name in self._local_only:
            self._local_only.remove(name)
        else:
            del self._regions[name]

    def descriptor(self) -> bytes:
        regions = {name: ShmRegion(*r) for name, r in self._regions.items()}
        return msgspec.msgpack.encode(
            ShmDescriptor(v=1, kind="shm", name=self.name, scope=self.scope, host=socket.gethostname(),
                          pid=os.getpid(), socket=self._sock_name, regions=regions)
        )  # fmt: skip

    def connect(self, descriptor: bytes) -> str:
        d = parse_descriptor(descriptor, self.scope)
        if d.host != socket.gethostname():
            raise TransferError(f"{d.name} runs on {d.host}: shared memory reaches this host only")
        maps: dict[str, tuple[mmap.mmap, int, int]] = {}
        try:
            for region, r in d.regions.items():
                offset, length = r.offset, r.length
                base = offset - offset % _PAGE
                with open(r.path, "r+b") as f:
                    maps[region] = (mmap.mmap(f.fileno(), offset - base + length, offset=base), offset - base, length)
        except (OSError, ValueError, OverflowError) as exc:  # missing file, a directory, a range past its end
            for mm, _, _ in maps.values():
                mm.close()
            raise TransferError(f"shared-memory descriptor of {d.name} names memory not mapped here: {exc}") from exc
        self.disconnect(d.name)
        self._peers[d.name] = _Peer(d.pid, d.socket, maps)
        return d.name

    def disconnect(self, peer: str) -> None:
        old = self._peers.pop(peer, None)
        for mm, _, _ in old.maps.values() if old else ():
            mm.close()

    def read(self, peer: str, ops: Sequence[Op], timeout_s: float, notify: bytes = b"") -> None:
        self._copy(peer, ops, to_remote=False, notify=notify)

    def write(self, peer: str, ops: Sequence[Op], timeout_s: float, notify: bytes = b"") -> None:
        self._copy(peer, ops, to_remote=True, notify=notify)

    def _copy(self, peer: str, ops: Sequence[Op], *, to_remote: bool, notify: bytes) -> None:
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"unknown peer {peer!r}: connect() its descriptor first")
        try:
            os.kill(p.pid, 0)
        except ProcessLookupError:
            raise TransferError(f"peer {peer} (pid {p.pid}) is gone; its memory is no longer served") from None
        except PermissionError:
            pass
        for o in ops:
            if o.region not in p.maps:
                raise TransferError(f"peer {peer} has no region {o.region!r}")
            mm, delta, length = p.maps[o.region]
            if o.remote_offset < 0 or o.remote_offset + o.length > length:
                raise TransferError(f"range [{o.remote_offset}, +{o.length}) is outside {o.region!r} ({length} bytes)")
            remote = ctypes.addressof(ctypes.c_char.from_buffer(mm, delta + o.remote_offset))
            dst, src = (remote, o.local_address) if to_remote else (o.local_address, remote)
            ctypes.memmove(dst, src, o.length)
        if notify:
            try:
                self._sock.sendto(self.name.encode() + b"\0" + notify, p.socket_name)
            except OSError as exc:
                raise TransferError(f"transfer done but {peer} could not be notified: {exc}") from exc

    def wait_notification(self, message: bytes, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            if (peer := pop_notification(self._pending, message)) is not None:
                return peer
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(f"no notification {message!r} within {timeout_s} s")
            self._sock.settimeout(remaining)
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            sender, _, msg = data.partition(b"\0")
            self._pending.append((sender.decode(), msg))

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        self._regions.clear()
        self._sock.close()
