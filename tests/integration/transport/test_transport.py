"""Conformance: every Transport between two real processes — byte-exact reads and writes, notifications,
and every failure a bounded TransferError.  Written against the interface; run on NIXL/UCX, the one
implementation (a same-node client maps a pool node's DRAM segment itself: ``DramSegment.attach``)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import crc32c
import numpy as np
import pytest

from kvpool.errors import TransferError, TransferInFlight
from kvpool.metadata.cache import MetadataCache
from kvpool.pool.client.peers import Peers
from kvpool.transport.base import Op, Transport
from kvpool.transport.nixl import NixlTransport

TARGET = str(Path(__file__).with_name("target.py"))
SIZE = 64 << 20


KINDS = ["nixl"]


def make(kind: str, **kw: object) -> Transport:
    assert kind == "nixl", kind
    return NixlTransport(**kw)  # type: ignore[arg-type]


class Target:
    def __init__(self, kind: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvpool-test-target-", dir="/dev/shm")
        self.proc = subprocess.Popen(
            [sys.executable, TARGET, self.dir, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.descriptor = bytes.fromhex(self._answer("DESCRIPTOR"))

    def _answer(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NIXL logs to stdout too: skip to our line
            if line.startswith(tag + " "):
                return line.split()[1]
        raise AssertionError(f"target exited without {tag}")

    def crc(self, offset: int, length: int) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"crc {offset} {length}\n")
        self.proc.stdin.flush()
        return int(self._answer("CRC"))

    def wait(self, message: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"wait {message}\n")
        self.proc.stdin.flush()
        return self._answer("FROM")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def target(kind: str) -> Iterator[Target]:
    t = Target(kind)
    yield t
    t.stop()


@pytest.fixture(scope="module")
def initiator(kind: str) -> Iterator[tuple[Transport, np.ndarray]]:
    transport = make(kind)
    buf = np.zeros(SIZE, dtype=np.uint8)
    transport.register("local", buf.ctypes.data, buf.nbytes)
    yield transport, buf
    transport.close()


def expected(offset: int, length: int) -> np.ndarray:
    return (np.arange(offset, offset + length, dtype=np.uint64) * 7 % 256).astype(np.uint8)


def test_read_is_byte_exact(target: Target, initiator: tuple[Transport, np.ndarray]) -> None:
    transport, buf = initiator
    peer = transport.connect(target.descriptor)
    addr = buf.ctypes.data
    ops = [
        Op("dram0", 0, addr, 16 << 20),
        Op("dram0", 40 << 20, addr + (16 << 20), 3 << 20),
        Op("dram0", 4097, addr + (20 << 20), 1),
    ]
    transport.read(peer, ops, timeout_s=30)
    assert np.array_equal(buf[: 16 << 20], expected(0, 16 << 20))
    assert np.array_equal(buf[16 << 20 : 19 << 20], expected(40 << 20, 3 << 20))
    assert buf[20 << 20] == expected(4097, 1)[0]


def test_write_is_byte_exact(target: Target, initiator: tuple[Transport, np.ndarray]) -> None:
    transport, buf = initiator
    peer = transport.connect(target.descriptor)
    data = np.random.default_rng(3).integers(0, 256, 8 << 20, dtype=np.uint8)
    buf[: data.nbytes] = data
    transport.write(peer, [Op("dram0", 32 << 20, buf.ctypes.data, data.nbytes)], timeout_s=30)
    assert target.crc(32 << 20, data.nbytes) == crc32c.crc32c(data)


def test_bad_requests_are_transfer_errors(target: Target, initiator: tuple[Transport, np.ndarray]) -> None:
    transport, buf = initiator
    peer = transport.connect(target.descriptor)
    with pytest.raises(TransferError, match="no region"):
        transport.read(peer, [Op("nope", 0, buf.ctypes.data, 1)], timeout_s=5)
    with pytest.raises(TransferError, match="outside"):
        transport.read(peer, [Op("dram0", SIZE - 1, buf.ctypes.data, 2)], timeout_s=5)
    with pytest.raises(TransferError, match="unknown peer"):
        transport.read("stranger", [Op("dram0", 0, buf.ctypes.data, 1)], timeout_s=5)
    with pytest.raises(TransferError, match="malformed"):
        transport.connect(b"\x00garbage")
    with pytest.raises(TransferError, match="malformed"):
        transport.connect(b"\x81\xa1v\x07")  # a descriptor of another version


def test_notification_follows_the_transfer(target: Target, initiator: tuple[Transport, np.ndarray]) -> None:
    transport, buf = initiator
    peer = transport.connect(target.descriptor)
    transport.read(peer, [Op("dram0", 0, buf.ctypes.data, 1 << 20)], timeout_s=30, notify=b"taken-7")
    assert target.wait("taken-7")  # the target learns who took it


def test_another_clusters_descriptor_is_refused(kind: str, target: Target) -> None:
    other = make(kind, scope="elsewhere")
    with pytest.raises(TransferError, match="belongs to cluster"):
        other.connect(target.descriptor)
    other.close()


def test_a_pool_clients_late_read_never_lands(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool client's side of a READ past its deadline (the late-READ hole): ``Peers.read`` answers a miss, and the
    caller fills the same memory at once, as an engine recomputes into the blocks a failed load was filling.  The
    peer goes on, a new transport reads from it again, and the caller's bytes stay: the set-aside transport's READ
    never lands."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    faults: list[str] = []
    peers = Peers(cast(MetadataCache, None), "", fault=faults.append)
    buf = np.zeros(SIZE, dtype=np.uint8)
    peers.register(buf)
    victim = Target(kind)
    try:
        first = peers.transport
        peers._connected["holder"] = first.connect(victim.descriptor)  # as _peer() connects from a node record
        assert peers.read("holder", [Op("dram0", 0, buf.ctypes.data, 4096)], pinned=False)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            assert not peers.read("holder", [Op("dram0", 0, buf.ctypes.data, 32 << 20)], pinned=False)
            assert peers.set_aside == 1 and peers.transport is not first and not peers.transport.fencing
            assert faults == ["read_failed", "late"]  # the client counts both (kvpool_transfer_faults_total)
            buf[: 32 << 20] = 0xA5  # the recompute
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        peers._connected["holder"] = peers.transport.connect(victim.descriptor)
        for _ in range(3):  # the peer serves again, through the new transport (its buffer registered anew)
            assert peers.read("holder", [Op("dram0", 0, buf.ctypes.data + (32 << 20), 8 << 20)])
            time.sleep(0.5)
        assert np.array_equal(buf[32 << 20 : 40 << 20], expected(0, 8 << 20))
        assert np.all(buf[: 32 << 20] == 0xA5)
    finally:
        victim.stop()
        peers.close()


@pytest.mark.timeout(120)  # bounded: a read that waited on the dead peer for ever would fail here, not hang the suite
def test_dead_peer_is_a_bounded_transfer_error(kind: str, initiator: tuple[Transport, np.ndarray]) -> None:
    transport, buf = initiator
    victim = Target(kind)
    peer = transport.connect(victim.descriptor)
    transport.read(peer, [Op("dram0", 0, buf.ctypes.data, 4096)], timeout_s=30)  # connected and working
    victim.stop()
    with pytest.raises(TransferError):
        transport.read(peer, [Op("dram0", 0, buf.ctypes.data, 8 << 20)], timeout_s=5)
    transport.disconnect(peer)


def test_a_process_with_a_nixl_agent_exits_cleanly() -> None:
    """UCX's InfiniBand modules, loaded on a host without RDMA devices, crashed every such process at exit."""
    code = "from kvpool.transport.nixl import NixlTransport; NixlTransport().close()"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_a_read_past_its_deadline_fences_its_memory(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ from a stopped peer (over TCP the target's worker serves a READ, so it stalls) passes its deadline
    and may land later: its memory is refused to other transfers until NIXL says that READ ended, and what lands
    then is the peer's bytes — the late write a retry into the same memory would have had overwritten."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    transport = make(kind)
    buf = np.zeros(SIZE, dtype=np.uint8)
    transport.register("local", buf.ctypes.data, buf.nbytes)
    victim = Target(kind)
    try:
        peer = transport.connect(victim.descriptor)
        transport.read(peer, [Op("dram0", 0, buf.ctypes.data, 4096)], timeout_s=30)  # connected and working
        buf[:] = 0
        ops = [Op("dram0", 0, buf.ctypes.data, 32 << 20)]
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TransferInFlight):
                transport.read(peer, ops, timeout_s=0.2)
            with pytest.raises(TransferInFlight, match="refused"):  # the stopped peer cannot have finished it
                transport.read(peer, [Op("dram0", 0, buf.ctypes.data + (8 << 20), 4096)], timeout_s=30)
            assert isinstance(transport, NixlTransport) and transport.fenced(buf.ctypes.data, 1)
            assert not transport.fenced(buf.ctypes.data + (32 << 20), 1)  # memory the READ does not touch is free
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120  # generous: a bound on a hang, not a timing claim
        while transport.fenced(buf.ctypes.data, 32 << 20) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not transport.fenced(buf.ctypes.data, 32 << 20)
        transport.read(peer, ops, timeout_s=60)  # the memory is usable again, and byte-exact
        assert np.array_equal(buf[: 32 << 20], expected(0, 32 << 20))
    finally:
        victim.stop()
        transport.close()
