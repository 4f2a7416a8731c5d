"""Loads of pool chunks into vLLM's paged blocks, for the connector's worker side (on its I/O thread).

A load is a list of jobs: one layer of one request's chunks each.  On the CPU (``PagedLayer.direct``: each block one
contiguous run of host memory) the jobs' objects land in the blocks themselves, all of them in one
``get_into_batch``, so the worker side hands over every layer at once where nothing waits for a layer before the
others (one round of node calls and transfers instead of one a layer), and one layer's jobs where the forward takes
the layers as they come.  Elsewhere (a GPU's KV) a job goes through a reused host staging buffer and is written
into its blocks by index."""

from typing import Any

import torch

from kvpool.core.keys import layer_key
from kvpool.prefill_decode.connector_core.reads import read_each
from kvpool.prefill_decode.connector_core.staging import EngineMemory, HostStaging
from kvpool.prefill_decode.vllm.blocks import PagedLayer
from kvpool.prefill_decode.vllm.groups import NULL_BLOCK, KvGroups
from kvpool.prefill_decode.vllm.scheduler import Transfer

#: one layer of one load: the layer, the load, its chunk keys (from ``t.first``), and the set its chunks that did not
#: come are added to (what landed of them in their blocks is reported with them, as load errors)
Job = tuple[PagedLayer, Transfer, list[bytes], set[int]]


class BlockLoads:
    """Chunks into vLLM's paged blocks: their host staging (sinks, staged layers) and vLLM's KV memory registered with
    the client's transport (reads from other nodes land in the blocks themselves)."""

    def __init__(self, groups: KvGroups, layers: dict[str, PagedLayer]) -> None:
        self.groups, self.layers = groups, layers  #: ``layers``: the worker side's, filled when vLLM registers them
        self.staging = HostStaging()  #: reused: sinks for blocks not to write, staged layers off the CPU
        self.memory = EngineMemory()

    def load(self, client: Any, jobs: list[Job]) -> int:
        """Load ``jobs`` (``direct`` layers in one batch, others one by one through staging); the bytes that
        landed in blocks."""
        direct = [job for job in jobs if job[0].direct]
        loaded = self._direct(client, direct) if direct else 0
        return loaded + sum(self._staged(client, *job) for job in jobs if not job[0].direct)

    def targets(self, layer: PagedLayer, t: Transfer) -> tuple[range, list[list[int | None]]]:
        """The chunks of ``t`` that ``layer`` loads (of a sliding window's, those inside the window of ``t``'s end)
        and, per chunk, the blocks its object lands in: ``None`` for vLLM's own blocks before ``write_from`` and for
        the null block, which are never written."""
        chunks = range(max(t.first, self.groups.first_chunk(layer.plan, t.end)), t.end)
        ids = t.block_ids[layer.plan.group]
        return chunks, [
            [ids[p] if t.write_from <= p < len(ids) and ids[p] != NULL_BLOCK else None for p in layer.positions(c)]
            for c in chunks
        ]

    def _direct(self, client: Any, jobs: list[Job]) -> int:
        """``jobs`` straight into their blocks with one ``get_into_batch``; the blocks not to write land in one sink,
        a region of it each (so what lands there is verified too)."""
        planned = [(layer, bad, *self.targets(layer, t), t, keys) for layer, t, keys, bad in jobs]
        skipped = [sum(b is None for blocks in p[3] for b in blocks) * p[0].block_bytes for p in planned]
        register = client.registrations > 0  # the client has a transport: reads from other nodes land in place
        if register:
            self.memory.register(client, self._kv_memory)
        sink = self.staging.get(client, sum(skipped), register=register and sum(skipped) > 0)
        lkeys: list[bytes] = []
        buffers: list[Any] = []
        at = 0
        for (layer, _, chunks, targets, t, keys), n in zip(planned, skipped, strict=True):
            lkeys += [layer_key(keys[c - t.first], layer.index) for c in chunks]
            buffers += layer.pieces(targets, sink[at : at + n])
            at += n
        missing = read_each(client, lkeys, buffers)
        at = loaded = 0
        for layer, bad, chunks, targets, _, _ in planned:
            bad.update(c for i, c in enumerate(chunks) if at + i in missing)
            at += len(chunks)
            loaded += landed(layer, chunks, targets, bad)
        return loaded

    def _staged(self, client: Any, layer: PagedLayer, t: Transfer, keys: list[bytes], bad: set[int]) -> int:
        """One job through the reused staging buffer, then into its blocks by index (KV that is not one run of host
        memory a block: a GPU's)."""
        chunks, targets = self.targets(layer, t)
        register = client.registrations > 0
        staging = layer.view(
            self.staging.get(client, len(chunks) * layer.tail * layer.block_bytes, register=register),
            len(chunks) * layer.tail,
        )
        views = [staging[i * layer.tail : (i + 1) * layer.tail] for i in range(len(chunks))]
        lkeys = [layer_key(keys[c - t.first], layer.index) for c in chunks]
        bad.update(chunks[i] for i in read_each(client, lkeys, views))
        rows = [
            i * layer.tail + j
            for i, c in enumerate(chunks)
            if c not in bad
            for j, b in enumerate(targets[i])
            if b is not None
        ]
        if rows:
            dest = [b for i, c in enumerate(chunks) if c not in bad for b in targets[i] if b is not None]
            layer.write(dest, staging if len(rows) == len(staging) else staging[rows])
        return landed(layer, chunks, targets, bad)

    def _kv_memory(self) -> list[torch.Tensor]:
        """vLLM's KV memory as flat byte tensors, one per storage (layers of several groups may share one)."""
        storages = {layer.kv.untyped_storage().data_ptr(): layer.kv for layer in self.layers.values()}
        return [torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage()) for kv in storages.values()]

    def close(self, client: Any) -> None:
        self.staging.close(client)
        self.memory.close(client)


def landed(layer: PagedLayer, chunks: range, targets: list[list[int | None]], bad: set[int]) -> int:
    """The bytes of ``layer``'s blocks that the chunks not in ``bad`` wrote."""
    return sum(b is not None for i, c in enumerate(chunks) if c not in bad for b in targets[i]) * layer.block_bytes
