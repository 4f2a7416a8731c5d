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

import msgpack

from kvpool.errors import TransferError
from kvpool.transport.base import Op, Transport, is_int_in, pop_notification, unpack_descriptor

_DESCRIPTOR_VERSION = 1
_DESCRIPTOR_FIELDS = frozenset({"v", "kind", "name", "scope", "host", "pid", "socket", "regions"})
_PAGE = mmap.PAGESIZE


def file_backing(address: int, length: int) -> tuple[str, int]:
    """``(path, file offset)`` of the shared file mapping that holds ``[address, address+length)``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address and address + length <= end and fields[1][3] == "s" and len(fields) == 6:
                return fields[5].strip(), int(fields[2], 16) + address - start
    raise ValueError(f"[{address:#x}, +{length}) is not inside a shared file mapping; ShmTransport serves only those")


@dataclass(frozen=True)
class ShmDescriptor:
    """A peer's shared-memory descriptor, checked (see :func:`parse_descriptor`)."""

    name: str
    host: str
    pid: int
    socket: bytes  #: the abstract Unix socket its notifications go to
    regions: dict[str, tuple[str, int, int]]  #: region → (file path, file offset, length)


def parse_descriptor(descriptor: bytes, scope: str) -> ShmDescriptor:
    """A descriptor made by :meth:`ShmTransport.descriptor` in cluster ``scope``; ``TransferError`` saying what
    is wrong otherwise.  Pure: it opens no file; :meth:`ShmTransport.connect` maps the regions afterwards."""
    d = unpack_descriptor(descriptor, "shared-memory", _DESCRIPTOR_VERSION, _DESCRIPTOR_FIELDS, scope)
    name, host, pid, sock, regions = d["name"], d["host"], d["pid"], d["socket"], d["regions"]
    if d["kind"] != "shm":
        raise TransferError(f"descriptor of {name} is of kind {d['kind']!r:.40}, not a shared-memory one")
    if not isinstance(host, str) or not host:
        raise TransferError(f"malformed shared-memory descriptor of {name}: host {host!r:.60}")
    if not is_int_in(pid, 1, 2**31):  # os.kill(pid, 0) probes it: 0 or -1 would probe a process group
        raise TransferError(f"malformed shared-memory descriptor of {name}: pid {pid!r:.60} is not a process id")
    if not isinstance(sock, bytes) or not sock:
        raise TransferError(f"malformed shared-memory descriptor of {name}: socket {sock!r:.60} is not a socket name")
    if not isinstance(regions, dict):
        raise TransferError(f"malformed shared-memory descriptor of {name}: regions is {type(regions).__name__}")
    out = {}
    for region, entry in regions.items():
        if not (isinstance(region, str) and region and isinstance(entry, list) and len(entry) == 3
                and isinstance(entry[0], str) and entry[0].startswith("/") and "\0" not in entry[0]
                and is_int_in(entry[1], 0, 2**63) and is_int_in(entry[2], 1, 2**63)):  # fmt: skip
            raise TransferError(
                f"malformed shared-memory descriptor of {name}: region {region!r:.40} → {entry!r:.80} is not "
                "name → [absolute path, offset >= 0, length >= 1]"
            )
        out[region] = (entry[0], entry[1], entry[2])
    return ShmDescriptor(name, host, pid, sock, out)


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
            raise ValueError(f"region {name!r} is registered already")
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
        return msgpack.packb(
            {"v": _DESCRIPTOR_VERSION, "kind": "shm", "name": self.name, "scope": self.scope, "host": socket.gethostname(),
             "pid": os.getpid(), "socket": self._sock_name, "regions": self._regions},
            use_bin_type=True,
        )  # fmt: skip

    def connect(self, descriptor: bytes) -> str:
        d = parse_descriptor(descriptor, self.scope)
        if d.host != socket.gethostname():
            raise TransferError(f"{d.name} runs on {d.host}: shared memory reaches this host only")
        maps: dict[str, tuple[mmap.mmap, int, int]] = {}
        try:
            for region, (path, offset, length) in d.regions.items():
                base = offset - offset % _PAGE
                with open(path, "r+b") as f:
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
