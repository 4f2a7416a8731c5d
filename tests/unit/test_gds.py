"""The NVMe<->GPU path (pool/gds.py): its automatic choice and override, and DeviceIO on every path this host has.

Without a GPU the choice logic runs against fake kvikio modules of each API generation, and the posix path's
pinned-bounce loop runs with CPU tensors routed through it; the CUDA tests run only where a GPU exists.
"""

import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.errors import ConfigError, SetupError
from kvpool.pool import gds
from kvpool.pool.gds import ENV, DeviceIO, IoPath, nvme_io_path
from kvpool.pool.segment import ALIGN, NvmeSegment

CAPACITY = 64 * ALIGN + 5  # the last block is partial, as in the pool
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a host without a CUDA device")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test chooses anew, from an environment without the override; later tests see the real choice."""
    monkeypatch.delenv(ENV, raising=False)
    nvme_io_path.cache_clear()
    yield
    nvme_io_path.cache_clear()


@pytest.fixture(params=[None, False], ids=["auto", "buffered"])
def nvme(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NvmeSegment]:
    with NvmeSegment.create(CAPACITY, str(tmp_path), direct=request.param) as seg:
        yield seg


POSIX = IoPath("posix", "chosen by the test")


def filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return t.to(device)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


# --- the choice -----------------------------------------------------------------------------------------


@no_cuda
def test_without_a_cuda_device_the_path_is_posix_and_says_why() -> None:
    path = nvme_io_path()
    assert path == IoPath("posix", path.reason)
    assert not path.uses_kvikio
    assert "no CUDA device" in path.reason and "torch.cuda.is_available() is False" in path.reason
    assert nvme_io_path() is path  # cached
    assert "kvikio" not in sys.modules  # imported lazily, and never where no GPU could use it


def test_env_forces_posix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, " POSIX ")
    path = nvme_io_path()
    assert path.name == "posix" and f"{ENV}=posix" in path.reason


@no_cuda
def test_env_kvikio_without_a_cuda_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "kvikio")
    with pytest.raises(SetupError, match=r"KVPOOL_NVME_IO=kvikio cannot be honoured: no CUDA device"):
        nvme_io_path()


@pytest.mark.parametrize("value", ["gds", "kvikio-compat", "yes"])
def test_env_values_other_than_posix_kvikio_auto_are_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.raises(
        ConfigError, match="KVPOOL_NVME_IO must be one of posix, kvikio, auto; unset it for automatic choice"
    ):
        nvme_io_path()


@no_cuda
@pytest.mark.parametrize("value", ["", "auto", "AUTO"])
def test_env_auto_is_the_automatic_choice(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV, value)
    assert nvme_io_path().name == "posix"


class CompatMode(SimpleNamespace):
    """Stands for kvikio's ``CompatMode`` enum (24.12-25.02 return one from ``defaults.compat_mode()``)."""


def fake_kvikio(api: str, compat: bool = False, gds_available: bool = True, probe_error: bool = False) -> Any:
    """A kvikio module of one API generation: ``"25.04"`` and later, ``"24.12"`` (to 25.02) or ``"24.10"``."""

    def gds_answer() -> bool:
        if probe_error:
            raise RuntimeError("cuFile error: libcufile.so.0: cannot open shared object file")
        return gds_available

    def driver_properties() -> Any:
        return SimpleNamespace(is_gds_available=gds_answer())

    if api == "25.04":
        defaults = SimpleNamespace(is_compat_mode_preferred=lambda: compat, get=lambda name: None)
        driver = SimpleNamespace(get=lambda name: {"is_gds_available": gds_answer()}[name])
        return SimpleNamespace(__version__="26.10.00", defaults=defaults, cufile_driver=driver)
    if api == "24.12":
        mode = CompatMode(name="ON" if compat else "AUTO")
        defaults = SimpleNamespace(compat_mode=lambda: mode)
        driver = SimpleNamespace(DriverProperties=driver_properties)
        return SimpleNamespace(__version__="24.12.01", defaults=defaults, cufile_driver=driver)
    assert api == "24.10"
    defaults = SimpleNamespace(compat_mode=lambda: compat)
    return SimpleNamespace(__version__="24.10.00", defaults=defaults, DriverProperties=driver_properties)


def on_a_gpu_host(monkeypatch: pytest.MonkeyPatch, kvikio: Any) -> None:
    monkeypatch.setattr(gds, "_cuda_devices", lambda: 2)

    def load() -> Any:
        if isinstance(kvikio, BaseException):
            raise kvikio
        return kvikio

    monkeypatch.setattr(gds, "_import_kvikio", load)


@pytest.mark.parametrize(
    ("kvikio", "name", "said"),
    [
        (fake_kvikio("25.04"), "gds", "kvikio 26.10.00 with cuFile and the GDS driver"),
        (fake_kvikio("25.04", compat=True), "kvikio-compat", "prefers compatibility mode"),
        (fake_kvikio("25.04", gds_available=False), "kvikio-compat", "cuFile driver not loaded (no nvidia-fs"),
        (fake_kvikio("25.04", probe_error=True), "kvikio-compat", "cuFile driver not loaded (cuFile error"),
        (fake_kvikio("24.12"), "gds", "kvikio 24.12.01 with cuFile"),
        (fake_kvikio("24.12", compat=True), "kvikio-compat", "prefers compatibility mode"),
        (fake_kvikio("24.12", gds_available=False), "kvikio-compat", "cuFile driver not loaded"),
        (fake_kvikio("24.10"), "gds", "kvikio 24.10.00 with cuFile"),
        (fake_kvikio("24.10", compat=True), "kvikio-compat", "prefers compatibility mode"),
        (
            ModuleNotFoundError("No module named 'kvikio'", name="kvikio"),
            "posix",
            "kvikio not installed: pip install kvikio-cu12",
        ),
        (
            ModuleNotFoundError("No module named 'cupy'", name="cupy"),
            "posix",
            "kvikio cannot be imported: it needs 'cupy'",
        ),
        (
            RuntimeError('Failure finding "libcufile.so.0"'),
            "posix",
            "kvikio is installed but failed to load (RuntimeError",
        ),
    ],
    ids=[
        "gds",
        "compat-preferred",
        "no-gds-driver",
        "driver-probe-fails",
        "24.12-gds",
        "24.12-compat-on",
        "24.12-no-gds-driver",
        "24.10-gds",
        "24.10-compat",
        "kvikio-missing",
        "kvikio-dependency-missing",
        "kvikio-fails-to-load",
    ],
)
def test_choice_on_a_gpu_host(monkeypatch: pytest.MonkeyPatch, kvikio: Any, name: str, said: str) -> None:
    on_a_gpu_host(monkeypatch, kvikio)
    path = nvme_io_path()
    assert path.name == name
    assert said in path.reason
    assert path.uses_kvikio == (name != "posix")


def test_env_kvikio_on_a_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "kvikio")
    on_a_gpu_host(monkeypatch, fake_kvikio("25.04", gds_available=False))
    path = nvme_io_path()
    assert path.name == "kvikio-compat" and path.reason.startswith(f"forced by {ENV}=kvikio; ")

    nvme_io_path.cache_clear()
    on_a_gpu_host(monkeypatch, ModuleNotFoundError("No module named 'kvikio'", name="kvikio"))
    with pytest.raises(SetupError, match=r"cannot be honoured: kvikio not installed: pip install kvikio-cu12"):
        nvme_io_path()
    nvme_io_path.cache_clear()
    monkeypatch.setenv(ENV, "posix")
    assert nvme_io_path().name == "posix"


# --- DeviceIO with CPU tensors: the posix path into the tensor's own memory ------------------------------

DTYPES = [
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_cpu_round_trip(nvme: NvmeSegment, dtype: torch.dtype) -> None:
    """Lengths of one byte to several blocks, none a multiple of ALIGN but (2, 1024) of uint8, at ALIGNed offsets."""
    with DeviceIO(nvme, POSIX) as io:
        for i, shape in enumerate([(), (1,), (4095,), (3, 5, 7), (2, 1024), (13, 515)]):
            src = filled(shape, dtype, seed=i)
            offset = 2 * ALIGN * i
            io.write_from_device(offset, src)
            dest = torch.empty_like(src)
            assert io.read_into_device(offset, dest) == src.nbytes
            assert torch.equal(dest, src), shape
            assert nvme.read(offset, src.nbytes) == tensor_bytes(src)  # the segment's own layout: the raw bytes


def test_cpu_tensors_take_posix_whatever_the_path_and_are_counted(nvme: NvmeSegment) -> None:
    io = DeviceIO(nvme)  # the automatic path: on a GPU host, CUDA tensors would go elsewhere; CPU ones never do
    src = filled((1000,), torch.float32)
    io.write_from_device(0, src)
    io.write_from_device(ALIGN, src[:3])
    dest = torch.empty(1000)
    io.read_into_device(0, dest)
    assert torch.equal(dest, src)
    counters = io.counters
    assert counters["posix_write_bytes"] == 4012 and counters["posix_write_calls"] == 2
    assert counters["posix_read_bytes"] == 4000 and counters["posix_read_calls"] == 1
    assert set(counters) >= {"posix_read_bytes", "posix_read_calls", "posix_write_bytes", "posix_write_calls"}
    stats = io.stats()
    assert stats["nvme_io"] == io.path.name and stats["nvme_io_reason"] == io.path.reason
    assert stats["posix_read_calls"] == 1
    io.close()
    io.close()  # idempotent
    assert not nvme.closed  # DeviceIO never closes the segment


def test_gradients_and_views_with_offsets(nvme: NvmeSegment) -> None:
    weights = torch.randn(64, requires_grad=True)
    base = torch.zeros(3, 64)
    with DeviceIO(nvme, POSIX) as io:
        io.write_from_device(0, weights)
        io.read_into_device(0, base[1])  # a contiguous view at a storage offset
    assert torch.equal(base[1], weights.detach())
    assert not base[0].any() and not base[2].any()


def test_direct_writes_keep_neighbouring_blocks(nvme: NvmeSegment) -> None:
    first, second = filled((ALIGN + 1,), torch.uint8, seed=1), filled((ALIGN,), torch.uint8, seed=2)
    with DeviceIO(nvme, POSIX) as io:
        io.write_from_device(0, first)  # two blocks
        io.write_from_device(2 * ALIGN, second)
        last_block = nvme.capacity // ALIGN * ALIGN
        tail = filled((nvme.capacity - last_block,), torch.uint8, seed=3)
        io.write_from_device(last_block, tail)
        back = torch.empty_like(first)
        io.read_into_device(0, back)
    assert torch.equal(back, first)
    assert nvme.read(2 * ALIGN, ALIGN) == tensor_bytes(second)
    assert nvme.read(last_block, tail.numel()) == tensor_bytes(tail)


# --- the pinned-bounce loop, run with CPU tensors routed through it ---------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, 2 * ALIGN, 2 * ALIGN + 1, 5 * ALIGN + 3])
def test_bounce_loop(monkeypatch: pytest.MonkeyPatch, nvme: NvmeSegment, nbytes: int) -> None:
    monkeypatch.setattr(gds, "_host_addressable", lambda t: False)  # what a CUDA tensor is
    src = filled((nbytes,), torch.uint8, seed=nbytes)
    with DeviceIO(nvme, POSIX, bounce_bytes=2 * ALIGN) as io:
        io.write_from_device(ALIGN, src)
        assert nvme.read(ALIGN, nbytes) == tensor_bytes(src)
        dest = torch.empty_like(src)
        assert io.read_into_device(ALIGN, dest) == nbytes
        assert torch.equal(dest, src)
        assert io.counters["posix_read_bytes"] == nbytes and io.counters["posix_write_calls"] == 1


# --- the kvikio path's bookkeeping, with a stand-in for kvikio.CuFile -------------------------------------


class FakeFuture:
    def __init__(self, result: int | Exception) -> None:
        self.result = result

    def get(self) -> int:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


class FakeCuFile:
    """pread/pwrite like kvikio's, on host memory, optionally failing or stopping short."""

    def __init__(self, file: str, fail: str = "") -> None:
        self.fd = os.open(file, os.O_RDWR)
        self.fail = fail
        self.closed = False

    def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> FakeFuture:
        if self.fail == "error":
            return FakeFuture(RuntimeError("cuFile error: CU_FILE_DRIVER_NOT_INITIALIZED"))
        data = os.pread(self.fd, size, file_offset)
        buf.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return FakeFuture(len(data) - (1 if self.fail == "short" else 0))

    def pwrite(self, buf: torch.Tensor, size: int, file_offset: int) -> FakeFuture:
        if self.fail == "error":
            return FakeFuture(RuntimeError("cuFile error: CU_FILE_DRIVER_NOT_INITIALIZED"))
        return FakeFuture(os.pwrite(self.fd, buf.numpy()[:size].tobytes(), file_offset))

    def close(self) -> None:
        os.close(self.fd)
        self.closed = True


@pytest.fixture
def fake_kvikio_io(monkeypatch: pytest.MonkeyPatch) -> list[FakeCuFile]:
    opened: list[FakeCuFile] = []

    def open_cufile(file: str) -> FakeCuFile:
        opened.append(FakeCuFile(file))
        return opened[-1]

    monkeypatch.setattr(gds, "_open_cufile", open_cufile)
    monkeypatch.setattr(gds, "_host_addressable", lambda t: False)
    monkeypatch.setattr(gds, "_sync_stream", lambda t: None)
    return opened


def test_kvikio_path_moves_and_counts(nvme: NvmeSegment, fake_kvikio_io: list[FakeCuFile]) -> None:
    src = filled((3, 1001), torch.bfloat16)
    with DeviceIO(nvme, IoPath("kvikio-compat", "test")) as io:
        io.write_from_device(ALIGN, src)
        assert nvme.read(ALIGN, src.nbytes) == tensor_bytes(src)  # bytes where the posix path puts them
        dest = torch.empty_like(src)
        assert io.read_into_device(ALIGN, dest) == src.nbytes
        assert torch.equal(dest, src)
        counters = io.counters
    assert counters["kvikio_compat_write_bytes"] == counters["kvikio_compat_read_bytes"] == src.nbytes
    assert counters["kvikio_compat_read_calls"] == 1 and counters["posix_read_calls"] == 0
    assert fake_kvikio_io[0].closed  # DeviceIO.close closed the CuFile


@pytest.mark.parametrize("fail", ["error", "short"])
def test_kvikio_failures_are_os_errors(nvme: NvmeSegment, fake_kvikio_io: list[FakeCuFile], fail: str) -> None:
    with DeviceIO(nvme, IoPath("gds", "test")) as io:
        fake_kvikio_io[0].fail = fail
        with pytest.raises(OSError, match="kvikio read") as info:
            io.read_into_device(0, torch.empty(100))
        assert info.value.errno == errno.EIO
        assert io.counters["gds_read_calls"] == 0


def test_kvikio_path_cannot_open_without_kvikio(nvme: NvmeSegment) -> None:
    if importlib_find("kvikio"):
        pytest.skip("kvikio is installed here")
    with pytest.raises(SetupError, match="needs kvikio, which cannot be imported"):
        DeviceIO(nvme, IoPath("gds", "test"))


def importlib_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# --- bad input --------------------------------------------------------------------------------------------


def test_bad_input_is_a_config_error_and_moves_nothing(nvme: NvmeSegment) -> None:
    io = DeviceIO(nvme, POSIX)
    cases: list[tuple[int, Any, str]] = [
        (1, torch.zeros(4), "must be a multiple of 4096"),
        (ALIGN + 512, torch.zeros(4), "must be a multiple of 4096"),
        (-ALIGN, torch.zeros(4), "outside segment"),
        (0, torch.zeros(nvme.capacity + 1, dtype=torch.uint8), "outside segment"),
        (nvme.capacity // ALIGN * ALIGN, torch.zeros(6, dtype=torch.uint8), "outside segment"),
        (0, torch.zeros(4, 4).t(), "contiguous"),
        (0, torch.zeros(8)[::2], "contiguous"),
        (0, torch.zeros(4).to_sparse(), "contiguous"),
        (0, torch.zeros(4, dtype=torch.complex64).conj(), "resolve_conj"),
        (0, torch.zeros(4, device="meta"), "device meta"),
        (0, np.zeros(4), "must be a torch.Tensor"),
    ]
    for offset, tensor, message in cases:
        with pytest.raises(ConfigError, match=message):
            io.write_from_device(offset, tensor)
        with pytest.raises(ConfigError, match=message):
            io.read_into_device(offset, tensor)
    assert not any(io.counters.values())
    with pytest.raises(ConfigError, match="bounce_bytes"):
        DeviceIO(nvme, POSIX, bounce_bytes=ALIGN + 1)


def test_closed_segment_or_device_io(tmp_path: Path) -> None:
    seg = NvmeSegment.create(4 * ALIGN, str(tmp_path))
    io = DeviceIO(seg, POSIX)
    seg.close()
    assert seg.closed
    with pytest.raises(ValueError, match=r"segment .* is closed"):
        io.read_into_device(0, torch.zeros(4))
    with NvmeSegment.create(4 * ALIGN, str(tmp_path)) as seg2, DeviceIO(seg2, POSIX) as io2:
        pass
    with pytest.raises(ValueError, match=r"DeviceIO of segment .* is closed"):
        io2.write_from_device(0, torch.zeros(4))


# --- CUDA: only where a GPU exists ------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel", [1, 4095, 3 * 1024 * 1024 + 7])
def test_cuda_round_trip_on_the_chosen_path(tmp_path: Path, dtype: torch.dtype, numel: int) -> None:
    path = nvme_io_path()
    src = filled((numel,), dtype, seed=numel, device="cuda")
    with NvmeSegment.create(32 << 20, str(tmp_path)) as seg, DeviceIO(seg) as io:
        assert io.path is path
        io.write_from_device(ALIGN, src)
        assert seg.read(ALIGN, src.nbytes) == tensor_bytes(src)
        dest = torch.full_like(src, 0)
        assert io.read_into_device(ALIGN, dest) == src.nbytes
        torch.cuda.synchronize()
        assert torch.equal(dest, src)
        kind = path.name.replace("-", "_")
        assert io.counters[f"{kind}_read_bytes"] == io.counters[f"{kind}_write_bytes"] == src.nbytes


@needs_cuda
def test_cuda_round_trip_through_the_pinned_bounce(tmp_path: Path) -> None:
    src = filled((5 * ALIGN + 3,), torch.uint8, device="cuda")
    with NvmeSegment.create(16 * ALIGN, str(tmp_path)) as seg, DeviceIO(seg, POSIX, bounce_bytes=2 * ALIGN) as io:
        io.write_from_device(0, src)
        dest = torch.empty_like(src)
        io.read_into_device(0, dest)
        assert torch.equal(dest, src)
        assert io.counters["posix_read_bytes"] == src.nbytes


@needs_cuda
def test_cuda_with_kvikio_agrees_with_the_posix_path(tmp_path: Path) -> None:
    pytest.importorskip("kvikio")
    path = nvme_io_path()
    assert path.uses_kvikio, path.reason
    a, b = (
        filled((100_000,), torch.float16, seed=1, device="cuda"),
        filled((9_999,), torch.int32, seed=2, device="cuda"),
    )
    with NvmeSegment.create(1 << 20, str(tmp_path)) as seg, DeviceIO(seg) as fast, DeviceIO(seg, POSIX) as slow:
        fast.write_from_device(0, a)
        slow.write_from_device(64 * ALIGN, b)
        a_back, b_back = torch.empty_like(a), torch.empty_like(b)
        slow.read_into_device(0, a_back)
        fast.read_into_device(64 * ALIGN, b_back)
        torch.cuda.synchronize()
        assert torch.equal(a_back, a) and torch.equal(b_back, b)
