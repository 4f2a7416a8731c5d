"""Reads into device (GPU) memory: chunks this node holds raw on NVMe go straight from the segment file into the
tensor — by GPUDirect Storage where the host has it (``nvme_io_path()``: ``gds``, else kvikio's compatibility
mode, else O_DIRECT and a host-to-device copy) — pinned on the node and not promoted.  Each is verified by its
checksum over a host copy of what landed; anything else goes the host way and is copied over."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.core.types import Placement, Tier
from kvpool.errors import KvPoolError
from kvpool.pool.buffers import byte_view
from kvpool.pool.chunks import checksum, short
from kvpool.pool.client.local import LocalNode

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _host_like(t: torch.Tensor) -> torch.Tensor:
    """A host buffer for ``t``'s bytes: page-locked when CUDA is there, so the copy to the device is a DMA."""
    import torch  # the caller holds tensors: loaded already

    return torch.empty(t.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class DeviceReads:
    """``local``: the pool node on this Ray node, as the client bound it (its NVMe segment file opened there)."""

    def __init__(self, node_id: str, local: LocalNode) -> None:
        self.node_id, self.local = node_id, local
        self.counts = {"direct": 0, "direct_bytes": 0, "via_host": 0, "via_host_bytes": 0}

    def get_into(
        self,
        keys: Sequence[bytes],
        flats: list[torch.Tensor],
        nearest: list[Placement],
        via_host: Callable[[list[bytes], list[Any]], object],
    ) -> None:
        """Read ``keys`` into the flat device views ``flats``; ``via_host`` is the client's ``get_into_batch``."""
        direct = [
            i
            for i, p in enumerate(nearest)
            if p.node == self.node_id and p.tier is Tier.NVME and p.codec == "raw" and p.stored == flats[i].numel()
        ]
        landed = self._direct(keys, flats, direct) if direct else set()
        rest = [i for i in range(len(keys)) if i not in landed]
        if not rest:
            return
        hosts = [flats[i] if flats[i].device.type == "cpu" else _host_like(flats[i]) for i in rest]
        via_host([keys[i] for i in rest], hosts)
        for i, host in zip(rest, hosts, strict=True):
            if host is not flats[i]:
                flats[i].copy_(host)
            self.counts["via_host"] += 1
            self.counts["via_host_bytes"] += host.numel()

    def _direct(self, keys: Sequence[bytes], flats: list[torch.Tensor], direct: list[int]) -> set[int]:
        """Pin the chunks at ``direct`` (not promoted) and read them from the segment file into their tensors;
        the indexes that landed intact."""
        bound = self.local.current()
        io = bound.device_io() if bound is not None else None
        if bound is None or io is None:
            return set()
        landed: set[int] = set()
        chunks = bound.handle.prepare_load([keys[i] for i in direct], promote=False).chunks
        try:
            for i, c in zip(direct, chunks, strict=True):
                if c is None or c.tier is not Tier.NVME or c.codec != "raw" or c.stored != flats[i].numel():
                    continue  # moved since the placement was read: the host path finds it
                try:
                    io.read_into_device(c.offset, flats[i])
                except (OSError, KvPoolError) as exc:  # the host path reads it instead
                    log.warning("direct NVMe read of %s failed: %s", short(c.key), exc)
                    continue
                if checksum(byte_view(flats[i].cpu())) == c.checksum:
                    landed.add(i)
                    self.counts["direct"] += 1
                    self.counts["direct_bytes"] += c.stored
        finally:
            bound.handle.complete_load([keys[i] for i in direct])
        return landed
