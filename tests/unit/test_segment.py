import ctypes
import errno
import logging
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvpool.errors import PoolFull, SetupError
from kvpool.pool import segment
from kvpool.pool.segment import ALIGN, DramSegment, NvmeSegment

SHM = "/dev/shm"
MiB = 1 << 20


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def allows_o_direct(directory: str) -> bool:
    """Whether the filesystem under ``directory`` accepts ``open(O_DIRECT)``."""
    probe = os.path.join(directory, f"kvpool-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    else:
        os.close(fd)
        return True
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.fixture
def dram() -> Iterator[DramSegment]:
    with DramSegment.create(1 * MiB) as seg:
        yield seg


# --- DramSegment ----------------------------------------------------------------------------------------


def test_dram_round_trip_of_any_contiguous_buffer(dram: DramSegment) -> None:
    dram.write(0, b"hello")
    dram.write(5, bytearray(b" "))
    dram.write(6, memoryview(b"world"))
    out = bytearray(11)
    assert dram.read_into(0, out) == 11
    assert out == b"hello world"

    tensor = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    dram.write(4096, tensor)
    back = np.empty_like(tensor)
    dram.read_into(4096, back)
    np.testing.assert_array_equal(back, tensor)


def test_dram_refuses_non_contiguous_and_read_only_buffers(dram: DramSegment) -> None:
    with pytest.raises(ValueError, match="non-contiguous"):
        dram.write(0, np.arange(16, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="read-only"):
        dram.read_into(0, b"immutable")


def test_attach_shares_bytes_both_ways(dram: DramSegment) -> None:
    dram.write(0, b"from owner")
    with DramSegment.attach(dram.path, dram.capacity) as peer:
        assert not peer.owner
        out = bytearray(10)
        peer.read_into(0, out)
        assert out == b"from owner"
        peer.write(100, b"from peer")
        out = bytearray(9)
        dram.read_into(100, out)
        assert out == b"from peer"
    assert os.path.exists(dram.path)  # the attached view's close never unlinks


def test_attach_across_processes(dram: DramSegment) -> None:
    dram.write(0, b"hello child")
    child = textwrap.dedent(f"""
        from kvpool.pool.segment import DramSegment
        with DramSegment.attach({dram.path!r}, {dram.capacity}) as seg:
            seen = bytearray(11)
            seg.read_into(0, seen)
            assert seen == b"hello child", seen
            seg.write(200, b"hello parent")
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=30)
    out = bytearray(12)
    dram.read_into(200, out)
    assert out == b"hello parent"


def test_attach_checks_the_file_size(dram: DramSegment) -> None:
    with pytest.raises(ValueError, match="holds"):
        DramSegment.attach(dram.path, dram.capacity + 1)


def test_view_is_zero_copy(dram: DramSegment) -> None:
    view = dram.view(64, 8)
    dram.write(64, b"abcdefgh")
    assert bytes(view) == b"abcdefgh"
    view[:4] = b"WXYZ"
    out = bytearray(8)
    dram.read_into(64, out)
    assert out == b"WXYZefgh"
    view.release()


def test_base_address_is_the_mapping(dram: DramSegment) -> None:
    data = random_bytes(4096)
    dram.write(8192, data)
    assert isinstance(dram.base_address, int) and dram.base_address != 0
    assert ctypes.string_at(dram.base_address + 8192, 4096) == data.tobytes()
    ctypes.memmove(dram.base_address + 16, b"poke", 4)
    with dram.view(16, 4) as view:
        assert bytes(view) == b"poke"


@pytest.mark.parametrize(("offset", "length"), [(-1, 1), (0, 1 * MiB + 1), (1 * MiB, 1), (1 * MiB - 3, 4)])
def test_dram_bounds(dram: DramSegment, offset: int, length: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        dram.view(offset, length)
    with pytest.raises(ValueError, match="outside"):
        dram.write(offset, bytes(length))
    with pytest.raises(ValueError, match="outside"):
        dram.read_into(offset, bytearray(length))


def test_close_unlinks_only_the_owned_file() -> None:
    seg = DramSegment.create(4096, name=f"test-{os.getpid()}-close")
    assert seg.path == f"{SHM}/kvpool-test-{os.getpid()}-close.seg"
    with pytest.raises(FileExistsError):
        DramSegment.create(4096, name=f"test-{os.getpid()}-close")
    DramSegment.attach(seg.path, 4096).close()
    assert os.path.exists(seg.path)
    seg.close()
    assert not os.path.exists(seg.path)
    seg.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        seg.write(0, b"x")


def test_close_with_a_live_view_raises_and_can_be_retried() -> None:
    seg = DramSegment.create(4096)
    view = seg.view(0, 16)
    with pytest.raises(BufferError, match="live views"):
        seg.close()
    assert os.path.exists(seg.path)
    view.release()
    seg.close()
    assert not os.path.exists(seg.path)


def test_too_large_dram_segment_fails_now() -> None:
    st = os.statvfs(SHM)
    huge = 2 * st.f_blocks * st.f_frsize + (1 << 30)  # far beyond the free space, which is at most the total
    name = f"test-{os.getpid()}-huge"
    with pytest.raises(PoolFull, match=f"{huge} bytes"):
        DramSegment.create(huge, name=name)
    assert not os.path.exists(f"{SHM}/kvpool-{name}.seg")


# --- NvmeSegment ----------------------------------------------------------------------------------------


def test_nvme_uses_o_direct_where_the_filesystem_allows(tmp_path: Path) -> None:
    with NvmeSegment.create(64 * ALIGN, str(tmp_path)) as seg:
        assert seg.direct == allows_o_direct(str(tmp_path))
        assert os.path.getsize(seg.path) == 64 * ALIGN


def test_nvme_on_tmpfs(caplog: pytest.LogCaptureFixture) -> None:
    """Kernels before 6.6 refuse O_DIRECT on tmpfs; newer ones accept it."""
    supported = allows_o_direct(SHM)
    with caplog.at_level(logging.WARNING, logger=segment.__name__), NvmeSegment.create(4 * ALIGN, SHM) as seg:
        assert seg.direct == supported
        seg.write(0, b"tmpfs")
        assert seg.read(0, 5) == b"tmpfs"
    assert len(caplog.records) == (0 if supported else 1)
    if not supported:
        with pytest.raises(SetupError, match="O_DIRECT"):
            NvmeSegment.create(4 * ALIGN, SHM, direct=True)


def test_nvme_falls_back_when_o_direct_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def refuse_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(segment.os, "open", refuse_direct)
    with caplog.at_level(logging.WARNING, logger=segment.__name__), NvmeSegment.create(4 * ALIGN, SHM) as seg:
        assert not seg.direct
        data = random_bytes(5000)
        seg.write(ALIGN, data)
        assert seg.read(ALIGN, 5000) == data.tobytes()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "does not support O_DIRECT" in caplog.records[0].getMessage()

    name = f"test-{os.getpid()}-demanded"
    with pytest.raises(SetupError, match="O_DIRECT"):
        NvmeSegment.create(4 * ALIGN, SHM, name=name, direct=True)
    assert not os.path.exists(f"{SHM}/kvpool-{name}.nvme")


@pytest.fixture(params=[None, False], ids=["auto", "buffered"])
def nvme(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NvmeSegment]:
    with NvmeSegment.create(24 * MiB + 5, str(tmp_path), direct=request.param) as seg:
        yield seg


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 3 * MiB + 5, 20 * MiB])
def test_nvme_round_trip(nvme: NvmeSegment, size: int) -> None:
    offset = 3 * ALIGN
    data = random_bytes(size, seed=size)
    nvme.write(offset, data)
    back = np.empty(size, dtype=np.uint8)
    assert nvme.read_into(offset, back) == size
    np.testing.assert_array_equal(back, data)
    assert nvme.read(offset, size) == data.tobytes()


def test_nvme_writes_keep_neighbouring_blocks(nvme: NvmeSegment) -> None:
    first, second = random_bytes(ALIGN + 1, seed=1), random_bytes(ALIGN, seed=2)
    nvme.write(0, first)  # occupies two blocks
    nvme.write(2 * ALIGN, second)
    assert nvme.read(0, ALIGN + 1) == first.tobytes()
    assert nvme.read(2 * ALIGN, ALIGN) == second.tobytes()
    last_block = nvme.capacity // ALIGN * ALIGN  # the segment ends 5 bytes into this block
    tail = random_bytes(nvme.capacity - last_block, seed=3)
    nvme.write(last_block, tail)
    assert nvme.read(last_block, tail.size) == tail.tobytes()
    assert nvme.read(0, ALIGN + 1) == first.tobytes()


def test_nvme_rejects_misaligned_and_out_of_bounds(nvme: NvmeSegment) -> None:
    for bad in (1, ALIGN - 1, ALIGN + 512):
        with pytest.raises(ValueError, match="multiple"):
            nvme.write(bad, b"x")
        with pytest.raises(ValueError, match="multiple"):
            nvme.read(bad, 1)
    last_block = nvme.capacity // ALIGN * ALIGN
    for offset, length in [(-ALIGN, 1), (last_block, 6), (last_block + ALIGN, 1), (0, nvme.capacity + 1)]:
        with pytest.raises(ValueError, match="outside"):
            nvme.write(offset, bytes(length))
        with pytest.raises(ValueError, match="outside"):
            nvme.read(offset, length)


def test_nvme_close_removes_only_when_asked(tmp_path: Path) -> None:
    seg = NvmeSegment.create(ALIGN, str(tmp_path), name="kept")
    assert seg.path == str(tmp_path / "kvpool-kept.nvme")
    seg.close(remove=False)
    assert os.path.exists(seg.path)
    os.unlink(seg.path)
    with NvmeSegment.create(ALIGN, str(tmp_path), name="gone") as seg:
        pass
    assert not os.path.exists(seg.path)
    seg.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        seg.read(0, 1)


def test_too_large_nvme_segment_fails_now() -> None:
    st = os.statvfs(SHM)  # tmpfs refuses at once; a real disk would fill up before saying no
    with pytest.raises(PoolFull, match="bytes free"):
        NvmeSegment.create(2 * st.f_blocks * st.f_frsize + (1 << 30), SHM)


def test_nvme_reads_and_writes_from_several_threads_at_once(tmp_path: Path) -> None:
    """Each thread has its own bounce buffer; page-aligned whole blocks (a mapped DRAM range) need none."""
    n, size = 16, 3 * 4096 + 123
    seg = NvmeSegment.create(n * 4 * 4096, str(tmp_path))
    blobs = [os.urandom(size) for _ in range(n)]
    aligned = mmap.mmap(-1, n * 4 * 4096)  # page-aligned, as a mapped segment is
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: seg.write(i * 4 * 4096, blobs[i]), range(n)))
            outs = list(pool.map(lambda i: seg.read(i * 4 * 4096, size), range(n)))
            assert outs == blobs
            with memoryview(aligned) as whole:
                views = [whole[i * 4 * 4096 : (i + 1) * 4 * 4096] for i in range(n)]
                list(pool.map(lambda i: seg.read_into(i * 4 * 4096, views[i]), range(n)))
                assert all(bytes(views[i][:size]) == blobs[i] for i in range(n))
                list(pool.map(lambda i: seg.write(i * 4 * 4096, views[(i + 1) % n]), range(n)))
                for v in views:
                    v.release()
        assert [seg.read(i * 4 * 4096, size) for i in range(n)] == blobs[1:] + blobs[:1]
    finally:
        seg.close()
        aligned.close()
