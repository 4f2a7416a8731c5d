"""The pool's one validated config object."""

import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool.errors import ConfigError
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.tiers.crypto import EncryptionConfig
from kvpool.pool.tiers.s3_config import RemoteConfig, check_codec

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Watermarks:
    """DRAM above ``high`` (a fraction of capacity) migrates LRU chunks to NVMe until ``low``."""

    high: float = 0.8
    low: float = 0.6

    def __post_init__(self) -> None:
        if not (_fraction(self.high) and _fraction(self.low) and 0 < self.low < self.high <= 1):
            raise ConfigError(f"watermarks must satisfy 0 < low < high <= 1, got low={self.low!r} high={self.high!r}")


@dataclass(frozen=True)
class PoolConfig:
    """What one node contributes to the pool, and how it behaves.

    ``dram_bytes`` / ``nvme_bytes`` of 0 mean "the default": a quarter of the free space in ``shm_dir`` and
    a tenth of the free space in ``nvme_dir``, capped at 4 GiB and 16 GiB.  ``nvme_dir`` empty means a
    fresh temporary directory, removed when the node stops; a directory given keeps the node's segment across
    restarts (``warm_restart``).  ``nvme_bytes < 0`` disables the NVMe tier.
    """

    metadata: MetadataConfig = field(default_factory=MetadataConfig)
    dram_bytes: int = 0
    nvme_bytes: int = 0
    shm_dir: str = "/dev/shm"
    nvme_dir: str = ""
    watermarks: Watermarks = field(default_factory=Watermarks)
    promote_on_hit: bool = True  #: a hit on an NVMe chunk copies it back to DRAM
    alignment: int = 4096
    namespace: str = "kvpool"  #: the Ray namespace of the PoolNode actors
    metrics_host: str = "127.0.0.1"  #: where each PoolNode serves Prometheus metrics
    metrics_port: int = 0  #: 0: a free port per node (published in its node record); -1: no metrics
    reservation_ttl_s: float = 30.0  #: room reserved but never committed (its writer died) is reclaimed after this
    busy_wait_s: float = 10.0  #: a move or remove of a chunk being read waits this long for the read, then ChunkBusy
    nvme_codec: str = "raw"  #: how chunks put as tensors are stored on NVMe (pool/tiers/codecs.py), e.g. "fp8-e4m3"
    #: with ``nvme_dir`` set, keep the NVMe segment and its journal across restarts: a node started again on the same
    #: host and address takes back every chunk that verifies (pool/node/journal.py); off: a fresh segment every start
    warm_restart: bool = True
    #: tenant -> (DRAM bytes, NVMe bytes) its chunks may take on each node (0: no limit): over it, its own least
    #: recently used chunks go first (pool/tenants.py; ``Tenants.quotas()`` gives these from a tenants file)
    quotas: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    remote: RemoteConfig = field(default_factory=RemoteConfig)  #: the S3 tier; off until ``remote.bucket`` is set
    #: encryption at rest of the NVMe tier: every chunk there sealed with AES-256-GCM (pool/tiers/crypto.py); off
    #: until a key file or variable is set.  The S3 tier has its own, ``remote.encryption``
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, MetadataConfig):
            raise ConfigError(f"metadata must be a MetadataConfig, got {type(self.metadata).__name__}")
        if not isinstance(self.watermarks, Watermarks):
            raise ConfigError(f"watermarks must be a Watermarks, got {type(self.watermarks).__name__}")
        if not isinstance(self.remote, RemoteConfig):
            raise ConfigError(f"remote must be a RemoteConfig, got {type(self.remote).__name__}")
        if not isinstance(self.encryption, EncryptionConfig):
            raise ConfigError(f"encryption must be an EncryptionConfig, got {type(self.encryption).__name__}")
        try:
            check_codec(self.nvme_codec)
        except ConfigError as exc:
            raise ConfigError(f"nvme_codec: {exc}") from None
        for name in ("shm_dir", "nvme_dir", "namespace", "metrics_host"):
            value = getattr(self, name)
            if not isinstance(value, str) or (not value and name != "nvme_dir"):
                raise ConfigError(f"{name} must be a {'' if name == 'nvme_dir' else 'non-empty '}string, got {value!r}")
        _check_quotas(self.quotas)
        for name in ("promote_on_hit", "warm_restart"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("dram_bytes", "nvme_bytes", "alignment"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                hint = (
                    " (sizes are not parsed: write e.g. 16 * GiB from kvpool.pool.config)"
                    if isinstance(value, str)
                    else ""
                )
                raise ConfigError(f"{name} must be an int number of bytes{hint}, got {value!r}")
        if self.dram_bytes < 0:
            raise ConfigError(f"dram_bytes must be >= 0 (0: default), got {self.dram_bytes}")
        if (
            not isinstance(self.metrics_port, int)
            or isinstance(self.metrics_port, bool)
            or not -1 <= self.metrics_port < 65536
        ):
            raise ConfigError(f"metrics_port must be -1 (off), 0 (free port) or a port, got {self.metrics_port!r}")
        if not _fraction(self.reservation_ttl_s) or self.reservation_ttl_s <= 0:
            raise ConfigError(f"reservation_ttl_s must be a number of seconds > 0, got {self.reservation_ttl_s!r}")
        if not _fraction(self.busy_wait_s) or self.busy_wait_s < 0:
            raise ConfigError(f"busy_wait_s must be a number of seconds >= 0, got {self.busy_wait_s!r}")
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {self.alignment}")
        if not os.path.isdir(self.shm_dir):
            raise ConfigError(f"shm_dir {self.shm_dir!r} is not a directory (the DRAM segment's file lives there)")
        if self.nvme_dir and not os.path.isdir(self.nvme_dir):
            raise ConfigError(
                f"nvme_dir {self.nvme_dir!r} is not a directory; create it or leave it empty for a temp dir"
            )

    def resolved_dram_bytes(self) -> int:
        if self.dram_bytes:
            return self.dram_bytes
        return min(shutil.disk_usage(self.shm_dir).free // 4, 4 * GiB) // MiB * MiB

    def resolved_nvme_dir(self, tag: str) -> str:
        """``nvme_dir``, or a fresh temporary directory named ``kvpool-nvme-<tag>-...``."""
        return self.nvme_dir or tempfile.mkdtemp(prefix=f"kvpool-nvme-{tag}-")

    def resolved_nvme_bytes(self, directory: str) -> int:
        if self.nvme_bytes:
            return max(self.nvme_bytes, 0)
        return min(shutil.disk_usage(directory).free // 10, 16 * GiB) // MiB * MiB


def _check_quotas(quotas: object) -> None:
    if not isinstance(quotas, Mapping):
        raise ConfigError(f"quotas must map tenant -> (DRAM bytes, NVMe bytes), got {type(quotas).__name__}")
    for tenant, limits in quotas.items():
        ok = isinstance(limits, tuple) and len(limits) == 2
        if not isinstance(tenant, str) or not tenant or not ok or not all(_int(n) and n >= 0 for n in limits):
            raise ConfigError(
                f"quotas: {tenant!r:.40} -> {limits!r:.40} is not tenant -> (DRAM bytes, NVMe bytes), ints >= 0"
            )


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fraction(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
