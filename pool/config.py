"""The pool's one validated config object."""

import os
import shutil
import sys
import tempfile
from typing import Annotated

from msgspec import Meta, field

from kvpool.core.config import Config, PowerOfTwo, Seconds
from kvpool.errors import ConfigError, SetupError
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.tiers.crypto import EncryptionConfig
from kvpool.pool.tiers.s3_config import RemoteConfig, check_codec

MiB = 1 << 20
GiB = 1 << 30

_Fraction = Annotated[float, Meta(gt=0, le=1, description="a fraction of DRAM capacity in (0, 1]")]
_Bytes = Annotated[
    int, Meta(description="an int number of bytes (sizes are not parsed: write e.g. 16 * GiB from kvpool.pool.config)")
]
_Text = Annotated[str, Meta(min_length=1, description="a non-empty string")]
_Quota = Annotated[int, Meta(ge=0, description="an int >= 0 in tenant -> (DRAM bytes, NVMe bytes) (0: no limit)")]


#: the directories a config names that must exist where it is checked, and what to do about one that does not
_DIRECTORIES = {
    "shm_dir": "the DRAM segment's file lives there (e.g. /dev/shm)",
    "nvme_dir": "create it, or leave it empty for a temp dir",
}


class Watermarks(Config, frozen=True):
    """DRAM above ``high`` (a fraction of capacity) migrates LRU chunks to NVMe until ``low``."""

    high: _Fraction = 0.8
    low: _Fraction = 0.6

    def check(self) -> None:
        if not self.low < self.high:
            raise ConfigError(f"watermarks must satisfy 0 < low < high <= 1, got low={self.low!r} high={self.high!r}")


class PoolConfig(Config, frozen=True):
    """What one node contributes to the pool, and how it behaves.

    ``dram_bytes`` / ``nvme_bytes`` of 0 mean "the default": a quarter of the free space in ``shm_dir`` and
    a tenth of the free space in ``nvme_dir``, capped at 4 GiB and 16 GiB.  ``nvme_dir`` empty means a
    fresh temporary directory, removed when the node stops; a directory given keeps the node's segment across
    restarts (``warm_restart``).  ``nvme_bytes < 0`` disables the NVMe tier.
    """

    metadata: MetadataConfig = field(default_factory=MetadataConfig)
    dram_bytes: Annotated[_Bytes, Meta(ge=0)] = 0
    nvme_bytes: _Bytes = 0
    shm_dir: Annotated[str, Meta(min_length=1, description="a directory, e.g. /dev/shm")] = "/dev/shm"
    nvme_dir: str = ""
    watermarks: Watermarks = field(default_factory=Watermarks)
    promote_on_hit: bool = True  #: a hit on an NVMe chunk copies it back to DRAM
    alignment: PowerOfTwo = 4096
    namespace: _Text = "kvpool"  #: the Ray namespace of the PoolNode actors
    metrics_host: _Text = "127.0.0.1"  #: where each PoolNode serves Prometheus metrics
    #: 0: a free port per node (published in its node record); -1: no metrics
    metrics_port: Annotated[int, Meta(ge=-1, le=65535, description="-1 (off), 0 (a free port) or a port")] = 0
    #: a room prepared for a store but never completed or aborted (its writer died) is reclaimed after this
    reservation_ttl_s: Seconds = 30.0
    #: a move or remove of a chunk being read waits this long for the read, then ChunkBusy
    busy_wait_s: Annotated[float, Meta(ge=0, le=sys.float_info.max, description="a number of seconds >= 0")] = 10.0
    nvme_codec: str = "raw"  #: how chunks put as tensors are stored on NVMe (pool/tiers/codecs.py), e.g. "fp8-e4m3"
    #: with ``nvme_dir`` set, keep the NVMe segment and its journal across restarts: a node started again on the same
    #: host and address takes back every chunk that verifies (pool/node/journal.py); off: a fresh segment every start
    warm_restart: bool = True
    #: tenant -> (DRAM bytes, NVMe bytes) its chunks may take on each node (0: no limit): over it, its own least
    #: recently used chunks go first (pool/tenants.py; ``Tenants.quotas()`` gives these from a tenants file)
    quotas: dict[_Text, tuple[_Quota, _Quota]] = field(default_factory=dict)
    remote: RemoteConfig = field(default_factory=RemoteConfig)  #: the remote tier; off until ``remote.bucket`` is set
    #: encryption at rest of the NVMe tier: every chunk there sealed with AES-256-GCM (pool/tiers/crypto.py); off
    #: until a key file or variable is set.  The remote tier has its own, ``remote.encryption``
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)

    def check(self) -> None:
        try:
            check_codec(self.nvme_codec)
        except ConfigError as exc:
            raise ConfigError(f"nvme_codec: {exc}") from None
        for name, what in _DIRECTORIES.items():
            if getattr(self, name) and not os.path.isdir(getattr(self, name)):
                raise SetupError(f"{name} {getattr(self, name)!r} is not a directory: {what}")

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
