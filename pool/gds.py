"""GPUDirect Storage for the NVMe tier: move chunk bytes between an :class:`~kvpool.pool.segment.NvmeSegment` and
a tensor, on the GPU or the CPU, by the fastest path this host has.

GPUDirect Storage (GDS) lets an NVMe drive DMA straight into GPU memory: NVIDIA's cuFile library, with the
``nvidia-fs`` kernel driver, maps the GPU buffer and the drive transfers to it without a copy through host memory.
kvikio (``pip install kvikio-cu12``, or ``pip install 'kvpool[gds]'``) is RAPIDS' Python binding of cuFile; where
cuFile or its driver is missing it runs in its *compatibility mode*: POSIX reads into a pinned host bounce buffer
inside kvikio, then a host-to-device copy, in a thread pool.

:func:`nvme_io_path` picks one of three paths, once per process (cached), and says why in a sentence:

- ``"gds"``: a CUDA device, kvikio importable, kvikio not in compatibility mode and the GDS driver loaded
  (kvikio's ``is_gds_available``).  NVMe to GPU memory by DMA.
- ``"kvikio-compat"``: a CUDA device and kvikio, but no cuFile library or no GDS driver (or ``KVIKIO_COMPAT_MODE=ON``):
  kvikio's own POSIX path, NVMe -> pinned bounce -> GPU.
- ``"posix"``: no CUDA device, or no kvikio: the pool's ``O_DIRECT`` path of :class:`NvmeSegment`, then a copy from a
  pinned host buffer to the device.

Force one with the environment variable ``KVPOOL_NVME_IO``: ``posix`` always holds; ``kvikio`` demands a CUDA
device and an importable kvikio and raises :class:`~kvpool.errors.ConfigError` (saying which is missing) where it
cannot be honoured; unset, empty or ``auto`` means automatic.  The variable is read on the first call.

A :class:`DeviceIO` binds one segment to the chosen path.  Tensors on the CPU always take the posix path, straight
into or out of their own memory; CUDA tensors take kvikio's where the path is ``gds`` or ``kvikio-compat``.  Its
:attr:`DeviceIO.path` and :meth:`DeviceIO.stats` show the path: a pool node reports ``nvme_io`` = the path's name
in its ``stats()`` and metrics, and the counters split bytes and calls by the path that actually moved them.

Offsets follow the segment's rules (multiples of :data:`~kvpool.pool.segment.ALIGN`; on a direct-mode segment the
posix path writes whole ``ALIGN`` blocks, the tail zero-padded; kvikio writes only the tensor's bytes, which the
allocator's whole-block ranges make equivalent).  kvikio in compatibility mode may go through the page cache while
the segment uses ``O_DIRECT``; Linux flushes or invalidates cached pages of a range before direct I/O on it, so
sequential reads and writes of one range by the two paths agree.  kvikio is imported lazily, only where a CUDA
device exists.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import importlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from msgspec import Meta

from kvpool.core.config import checked, validated
from kvpool.errors import ConfigError, SetupError
from kvpool.pool.buffers import byte_view, tensor_bytes
from kvpool.pool.segment import ALIGN, CHUNK

if TYPE_CHECKING:
    from types import TracebackType

    import torch

    from kvpool.pool.segment import NvmeSegment

logger = logging.getLogger(__name__)

ENV = "KVPOOL_NVME_IO"  #: Environment variable that forces a path: ``posix`` or ``kvikio``.
INSTALL_HINT = "pip install kvikio-cu12 (or pip install 'kvpool[gds]')"

PathName = Literal["gds", "kvikio-compat", "posix"]


@dataclass(frozen=True)
class IoPath:
    """The NVMe<->GPU path in use and the reason it was chosen (a sentence, for logs and stats)."""

    name: PathName
    reason: str

    @property
    def uses_kvikio(self) -> bool:
        """Whether CUDA tensors go through kvikio (``gds`` or ``kvikio-compat``)."""
        return self.name != "posix"


@functools.cache
def nvme_io_path() -> IoPath:
    """The path this process uses for NVMe<->GPU transfers, chosen on the first call (see the module docstring).

    Raises :class:`ConfigError` where ``KVPOOL_NVME_IO`` is not ``posix``/``kvikio``/``auto``, :class:`SetupError`
    where it cannot be honoured; a failed call is not cached.
    """
    path = _choose(os.environ.get(ENV, ""))
    logger.info("NVMe I/O path: %s (%s)", path.name, path.reason)
    return path


_Setting = Annotated[
    Literal["", "auto", "posix", "kvikio"],
    Meta(description="one of posix, kvikio, auto; unset it for automatic choice"),
]
_Bounce = Annotated[int, Meta(gt=0, multiple_of=ALIGN, description=f"a positive multiple of {ALIGN}")]


def _choose(setting: str) -> IoPath:
    forced = validated(_Setting, setting.strip().lower(), ENV)
    if forced == "posix":
        return IoPath("posix", f"forced by {ENV}=posix: O_DIRECT into host memory, then a host-to-device copy")
    demanded = forced == "kvikio"
    devices = _cuda_devices()
    if devices == 0:
        return _refuse_or_posix(demanded, "no CUDA device (torch.cuda.is_available() is False)")
    try:
        kvikio = _import_kvikio()
    except ModuleNotFoundError as e:
        if e.name is not None and e.name != "kvikio" and not e.name.startswith("kvikio."):
            return _refuse_or_posix(
                demanded, f"kvikio cannot be imported: it needs {e.name!r} ({_said(e)}); {INSTALL_HINT}"
            )
        return _refuse_or_posix(demanded, f"kvikio not installed: {INSTALL_HINT}")
    except Exception as e:  # kvikio raises RuntimeError/OSError when libkvikio, libcufile or libcuda cannot be loaded
        return _refuse_or_posix(demanded, f"kvikio is installed but failed to load ({type(e).__name__}: {_said(e)})")
    uses_gds, why = _kvikio_mode(kvikio)
    prefix = f"forced by {ENV}=kvikio; " if demanded else ""
    return IoPath("gds" if uses_gds else "kvikio-compat", f"{prefix}{why}; {devices} CUDA device(s)")


def _refuse_or_posix(demanded: bool, why: str) -> IoPath:
    if demanded:
        raise SetupError(f"{ENV}=kvikio cannot be honoured: {why}; unset it or set {ENV}=posix")
    return IoPath("posix", f"{why}: O_DIRECT into host memory, then a host-to-device copy")


def _cuda_devices() -> int:
    """How many CUDA devices torch sees (0 on a CPU build), without initialising torch's CUDA state.

    Without an NVIDIA device file (``/dev/nvidia0``..., WSL's ``/dev/dxg``) CUDA finds no device either, and torch is
    not imported just to say so: a pool node's stats and metrics ask at start, and torch costs a node process a
    second or more to import."""
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/dxg"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _import_kvikio() -> Any:
    """Import kvikio and the submodules :func:`_kvikio_mode` reads (those this version has)."""
    import kvikio

    importlib.import_module("kvikio.defaults")
    with contextlib.suppress(ModuleNotFoundError):
        importlib.import_module("kvikio.cufile_driver")  # 24.12 and later
    return kvikio


def _kvikio_mode(kvikio: Any) -> tuple[bool, str]:
    """Whether kvikio will use cuFile with the GDS driver (``True``) or its compatibility mode, and why.

    Reads the API of kvikio 25.04 and later (``defaults.is_compat_mode_preferred()``,
    ``cufile_driver.get("is_gds_available")``) and falls back to 24.12-25.02's (``defaults.compat_mode()`` returning
    a ``CompatMode``, ``cufile_driver.DriverProperties()``) and 24.10's (``compat_mode()`` returning a bool,
    ``kvikio.DriverProperties()``).
    """
    version = getattr(kvikio, "__version__", "(unknown version)")
    defaults = kvikio.defaults
    try:
        if hasattr(defaults, "is_compat_mode_preferred"):
            compat = bool(defaults.is_compat_mode_preferred())
        else:
            mode = defaults.compat_mode()
            compat = mode is True or getattr(mode, "name", None) == "ON"
    except Exception as e:
        return (
            False,
            f"kvikio {version} could not report its compatibility mode ({_said(e)}): assuming compatibility mode",
        )
    if compat:
        return False, (
            f"kvikio {version} prefers compatibility mode (libcufile not found, or KVIKIO_COMPAT_MODE=ON): "
            "it reads through its own pinned bounce buffer"
        )
    try:
        driver = getattr(kvikio, "cufile_driver", None)
        if driver is not None and hasattr(driver, "get"):
            gds = bool(driver.get("is_gds_available"))
        elif driver is not None and hasattr(driver, "DriverProperties"):
            gds = bool(driver.DriverProperties().is_gds_available)
        else:
            gds = bool(kvikio.DriverProperties().is_gds_available)
    except Exception as e:
        return False, f"cuFile driver not loaded ({_said(e)}): kvikio runs in compatibility mode"
    if not gds:
        return False, "cuFile driver not loaded (no nvidia-fs GDS driver): kvikio runs in compatibility mode"
    return True, f"kvikio {version} with cuFile and the GDS driver: NVMe to GPU memory by DMA"


def _sync_stream(t: torch.Tensor) -> None:
    """Wait for ``t``'s device's current stream: cuFile is not stream-ordered, so kernels still writing (or reading)
    ``t`` must finish before kvikio touches it."""
    import torch

    torch.cuda.current_stream(t.device).synchronize()


def _host_addressable(t: torch.Tensor) -> bool:
    """Whether the segment can read into or write from ``t``'s memory directly (a CPU tensor)."""
    return t.device.type == "cpu"


class DeviceIO:
    """Reads and writes one :class:`NvmeSegment` from and to tensors on the path :attr:`path`.

    Invariants: the segment stays owned by its creator (closing this object never closes it); offsets are
    multiples of ``ALIGN`` and a transfer stays inside ``[0, segment.capacity)``, checked before any byte moves,
    so bad input is a :class:`ConfigError` whichever path runs.  CUDA tensors on the posix path go through one
    pinned host buffer of ``bounce_bytes`` (allocated on first use), guarded by a lock, so concurrent calls
    serialise there; the kvikio path runs calls concurrently in kvikio's thread pool.  I/O failures are
    ``OSError`` on every path (kvikio's errors are translated).
    """

    @checked
    def __init__(self, segment: NvmeSegment, path: IoPath | None = None, bounce_bytes: _Bounce = CHUNK) -> None:
        self.segment = segment
        self.path: IoPath = nvme_io_path() if path is None else path  #: The path CUDA tensors take.
        self.bounce_bytes = bounce_bytes
        self._lock = threading.Lock()  # guards _bounce and _counters
        self._bounce: torch.Tensor | None = None
        self._file: Any = _open_cufile(segment.path) if self.path.uses_kvikio else None  # a kvikio.CuFile
        self._closed = False
        kinds = {"posix", _counter_prefix(self.path.name)}
        self._counters = {
            f"{k}_{op}_{unit}": 0 for k in sorted(kinds) for op in ("read", "write") for unit in ("bytes", "calls")
        }

    @property
    def counters(self) -> dict[str, int]:
        """``<path>_<read|write>_<bytes|calls>`` for the posix path and this object's path (``kvikio_compat`` for
        ``kvikio-compat``): what each path moved; CPU tensors always count as posix."""
        with self._lock:
            return dict(self._counters)

    def stats(self) -> dict[str, int | str]:
        """``nvme_io`` (the path's name), ``nvme_io_reason`` and the :attr:`counters`."""
        return {"nvme_io": self.path.name, "nvme_io_reason": self.path.reason, **self.counters}

    def read_into_device(self, offset: int, dest: torch.Tensor) -> int:
        """Fill ``dest`` (contiguous, on the CPU or a CUDA device) from ``offset``; returns the bytes read."""
        view = self._bytes_of(dest, "dest")
        n = view.numel()
        self._check_range(offset, n)
        if _host_addressable(dest):
            self.segment.read_into(offset, _host_buffer(view))
            kind = "posix"
        elif self._file is not None:
            self._kvikio("read", offset, view)
            kind = _counter_prefix(self.path.name)
        else:
            self._bounced("read", offset, view)
            kind = "posix"
        self._count(kind, "read", n)
        return n

    def write_from_device(self, offset: int, src: torch.Tensor) -> None:
        """Write ``src`` (contiguous, on the CPU or a CUDA device) at ``offset``."""
        view = self._bytes_of(src, "src")
        n = view.numel()
        self._check_range(offset, n)
        if _host_addressable(src):
            self.segment.write(offset, _host_buffer(view))
            kind = "posix"
        elif self._file is not None:
            self._kvikio("write", offset, view)
            kind = _counter_prefix(self.path.name)
        else:
            self._bounced("write", offset, view)
            kind = "posix"
        self._count(kind, "write", n)

    def close(self) -> None:
        """Close kvikio's file handle and free the bounce buffer; the segment stays open.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        with self._lock:
            self._bounce = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _bytes_of(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """:func:`tensor_bytes` of a tensor on the CPU or a CUDA device."""
        view = tensor_bytes(t, what)
        if t.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"{what} is on device {t.device}; DeviceIO moves bytes to CPU or CUDA tensors only")
        return view

    def _check_range(self, offset: int, length: int) -> None:
        """The segment's own checks of an I/O range (open, aligned, inside), and this object's: open."""
        if self._closed:
            raise ConfigError(f"DeviceIO of segment {self.segment.path} is closed")
        self.segment.fd_for(offset, length)

    def _kvikio(self, op: Literal["read", "write"], offset: int, buf: torch.Tensor) -> None:
        """One kvikio ``pread``/``pwrite`` of all of ``buf`` (a CUDA uint8 tensor), waited on."""
        n = buf.numel()
        if n == 0:
            return
        _sync_stream(buf)
        call = self._file.pread if op == "read" else self._file.pwrite
        try:
            moved = call(buf, size=n, file_offset=offset).get()
        except Exception as e:  # kvikio raises RuntimeError with the C++ message
            raise OSError(
                errno.EIO, f"kvikio {op} of {n} bytes at {offset} of {self.segment.path} failed: {_said(e)}"
            ) from e
        if moved != n:
            raise OSError(errno.EIO, f"kvikio {op} moved {moved} of {n} bytes at {offset} of {self.segment.path}")

    def _bounced(self, op: Literal["read", "write"], offset: int, buf: torch.Tensor) -> None:
        """Move ``buf`` (device memory) through the pinned host buffer, ``bounce_bytes`` at a time."""
        import torch

        n = buf.numel()
        with self._lock:
            if self._bounce is None:
                self._bounce = torch.empty(self.bounce_bytes, dtype=torch.uint8, pin_memory=buf.is_cuda)
            host = self._bounce
            host_bytes = _host_buffer(host)
            for pos in range(0, n, self.bounce_bytes):
                m = min(self.bounce_bytes, n - pos)
                # offset + pos stays ALIGNed: bounce_bytes is a multiple of ALIGN; only the last piece can be short
                if op == "read":
                    self.segment.read_into(offset + pos, host_bytes[:m])
                    buf[pos : pos + m].copy_(host[:m])  # synchronous: host is reused by the next piece
                else:
                    host[:m].copy_(buf[pos : pos + m])
                    self.segment.write(offset + pos, host_bytes[:m])

    def _count(self, kind: str, op: str, n: int) -> None:
        with self._lock:
            self._counters[f"{kind}_{op}_bytes"] += n
            self._counters[f"{kind}_{op}_calls"] += 1


def _host_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a CPU uint8 tensor's memory (no copy), for the segment's buffer-taking calls."""
    return byte_view(t)


def _said(e: BaseException) -> str:
    """An exception's message on one line (kvikio's and cuda-pathfinder's span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def _counter_prefix(name: PathName) -> str:
    return name.replace("-", "_")


def _open_cufile(file: str) -> Any:
    """``kvikio.CuFile(file, "r+")``: registered with cuFile where GDS is available; errors are SetupError."""
    try:
        kvikio = _import_kvikio()
    except Exception as e:
        raise SetupError(f"the kvikio path needs kvikio, which cannot be imported ({_said(e)}); {INSTALL_HINT}") from e
    try:
        return kvikio.CuFile(file, "r+")
    except Exception as e:
        raise SetupError(f"kvikio cannot open {file} for GDS I/O ({_said(e)}); set {ENV}=posix to bypass kvikio") from e
