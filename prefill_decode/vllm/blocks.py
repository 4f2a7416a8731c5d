"""One layer of vLLM's paged KV cache as the connector's worker side moves it: blocks gathered or written by index,
or (on the CPU, where each block is one contiguous run of host memory) handed to the pool as the runs of blocks a
chunk's object lands in or comes from."""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kvpool.pool.buffers import byte_view
from kvpool.prefill_decode.vllm.groups import PoolLayer


@dataclass
class PagedLayer:
    """One layer of vLLM's paged KV as the pool moves it: its tensor, which dimension indexes blocks, and the
    blocks of a chunk its objects hold."""

    plan: PoolLayer
    kv: torch.Tensor
    block_dim: int  #: the dimension of ``kv`` that indexes blocks
    tail: int  #: blocks of a chunk its objects hold: a chunk's last ``tail`` blocks
    bpc: int  #: blocks per chunk

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def index(self) -> int:
        return self.plan.index

    def positions(self, chunk: int) -> range:
        """The positions (in a request's block list) of the blocks of ``chunk`` that this layer stores."""
        return range((chunk + 1) * self.bpc - self.tail, (chunk + 1) * self.bpc)

    def gather(self, ids: list[int]) -> torch.Tensor:
        """Blocks ``ids`` copied now into a tensor of their own, block-major."""
        index = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(self.block_dim, index).movedim(self.block_dim, 0).to("cpu").contiguous()

    def blocks(self, ids: list[int], out: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` copied into ``out`` (a host buffer of at least their bytes), block-major:
        ``[len(ids), *one block]``."""
        index = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        dest = self.view(out, len(ids))
        if self.block_dim == 0 and self.kv.device == dest.device:
            torch.index_select(self.kv, 0, index, out=dest)
        else:
            dest.copy_(self.kv.index_select(self.block_dim, index).movedim(self.block_dim, 0))
        return dest

    def view(self, buffer: torch.Tensor, blocks: int) -> torch.Tensor:
        """The first ``blocks`` blocks' worth of a flat uint8 ``buffer``, as ``[blocks, *one block]`` of our dtype."""
        return buffer[: blocks * self.block_bytes].view(self.kv.dtype).view(blocks, *self.block_shape)

    @property
    def direct(self) -> bool:
        """Whether a chunk's bytes can land straight in the blocks: each block one contiguous run of host memory."""
        return self.block_dim == 0 and self.kv.device.type == "cpu" and self.kv.is_contiguous()

    @cached_property
    def _bytes(self) -> memoryview:
        """``kv``'s memory as one flat byte view (``direct`` layers only), made once: a region of it is a slice,
        where a tensor per region cost ~40 us to turn into the view the pool takes, ~3 ms a load of 64 regions."""
        return byte_view(self.kv, writable=True, field="the KV cache tensor")

    def pieces(
        self, targets: Sequence[Sequence[int | None]], sink: torch.Tensor | None = None
    ) -> list[list[memoryview]]:
        """Per chunk, the regions its bytes land in (or, for a save, come from), in order: runs of consecutive blocks
        of ``kv`` for the blocks ``targets`` names, and for those it does not (``None``: vLLM's own, or the null
        block) a region of ``sink`` (a flat uint8 buffer of their bytes, each such block a place of its own, so what
        lands can be verified).  ``direct`` layers only."""
        kv, size = self._bytes, self.block_bytes
        spare = byte_view(sink, writable=True, field="the sink") if sink is not None else None
        out: list[list[memoryview]] = []
        at = 0
        for blocks in targets:
            runs: list[tuple[int | None, int]] = []  #: (first block or None for the sink, blocks)
            for b in blocks:
                if runs:
                    first, n = runs[-1]
                    if (first is None and b is None) or (first is not None and b is not None and b == first + n):
                        runs[-1] = (first, n + 1)
                        continue
                runs.append((b, 1))
            regions = []
            for first, n in runs:
                if first is None:
                    assert spare is not None, "blocks to skip need a sink"
                    regions.append(spare[at : at + n * size])
                    at += n * size
                else:
                    regions.append(kv[first * size : (first + n) * size])
            out.append(regions)
        return out

    def write(self, ids: list[int], data: torch.Tensor) -> None:
        """Put block-major ``data`` (as :meth:`blocks` gives it) into blocks ``ids``."""
        index = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(self.block_dim, index, data.to(self.kv.device).movedim(0, self.block_dim))

    @property
    def block_shape(self) -> list[int]:
        return [n for d, n in enumerate(self.kv.shape) if d != self.block_dim]

    @property
    def block_bytes(self) -> int:
        return self.kv.numel() // self.kv.shape[self.block_dim] * self.kv.element_size()
