"""Measure the cost model's inputs on this cluster: a model's effective FLOP/s, and each tier's read
bandwidth as the pool delivers it to this process (same code path as a real reload)."""

import os
import statistics
import time

import numpy as np
import torch

from kvpool.core.types import Tier
from kvpool.pool.client import PoolClient
from kvpool.prefill_decode.reference.model import LoadedModel, forward, kv_cache
from kvpool.prefill_decode.routing.cost import CostModel, Hardware, ModelSpec


def spec_of(loaded: LoadedModel) -> ModelSpec:
    """The cost model's view of a loaded model; ``P`` counts the weights every token passes through (the
    decoder layers, not the embedding table; the LM head runs for the last token only)."""
    params = sum(p.numel() for p in loaded.model.model.layers.parameters())
    return ModelSpec.from_hf_config(
        loaded.model.config, name=loaded.name, params=params, kv_dtype_bytes=loaded.dtype.itemsize
    )


@torch.no_grad()
def measure_flops(loaded: LoadedModel, tokens: int = 1024, repeats: int = 3) -> float:
    """Effective FLOP/s of a full prefill of ``tokens`` random tokens (median of ``repeats``, after a warm-up),
    counting causal attention."""
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(loaded.device)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        loaded.model(ids, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    flops = CostModel(spec_of(loaded), Hardware(1.0, {}, "count"), attention=True).prefill_flops(tokens)
    return flops / statistics.median(times[1:])


def measure_reads(
    client: PoolClient, object_bytes: int, total_bytes: int = 16 << 20, repeats: int = 3
) -> tuple[dict[str, float], float]:
    """Read bandwidth (bytes/s) per read path of this node, and the fixed latency of one read (s).

    Times ``get_into_batch`` of ``total_bytes`` in objects of ``object_bytes`` — the way a reload reads —
    from this node's DRAM and, when the node has one, its NVMe (a read there promotes the chunk back to
    DRAM, as a real hit does), and, when the pool has another node, from that node's DRAM (``peer``: the
    network); and of a single object from DRAM, which is the latency (one pin round trip and a copy).
    Bandwidth is the large read's bytes over its time less that latency.  Uses throw-away keys and
    removes them."""
    rng = np.random.default_rng()
    objects = max(1, total_bytes // object_bytes)
    keys = [os.urandom(32) for _ in range(objects)]
    peer_keys = [os.urandom(32) for _ in range(objects)]
    data = rng.integers(0, 256, (objects, object_bytes), dtype=np.uint8)
    out = np.empty_like(data)
    nodes = client.cache.nodes()
    here = next((n for n in nodes if n.node_id == client.node_id), None)
    peer = next((n for n in nodes if n.node_id != client.node_id and n.capacity(Tier.DRAM) > 0), None)
    client.put_batch(list(zip(keys, data, strict=True)), nodes=[here.node_id] if here else [])
    if peer is not None:
        client.put_batch(list(zip(peer_keys, data, strict=True)), nodes=[peer.node_id])
    has_nvme = here is not None and here.capacity(Tier.NVME) > 0

    def timed(keys: list[bytes], tier: Tier = Tier.DRAM) -> float:
        times = []
        for _ in range(repeats):
            if tier is Tier.NVME:
                client.move(keys, Tier.NVME)
            t0 = time.perf_counter()
            client.get_into_batch(keys, list(out[: len(keys)]))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    try:
        latency = timed(keys[:1])
        paths = {Tier.DRAM.value: (keys, Tier.DRAM)}
        if has_nvme:
            paths[Tier.NVME.value] = (keys, Tier.NVME)
        if peer is not None:
            paths["peer"] = (peer_keys, Tier.DRAM)
        bandwidth = {name: data.nbytes / max(timed(k, t) - latency, 1e-6) for name, (k, t) in paths.items()}
    finally:
        client.remove_batch(keys + (peer_keys if peer is not None else []))
    return bandwidth, latency


@torch.no_grad()
def measure_step(loaded: LoadedModel, repeats: int = 5) -> float:
    """The fixed cost of a forward pass: a one-token step after an 8-token prompt (median, after a warm-up)."""
    ids = torch.arange(9, device=loaded.device).unsqueeze(0) % loaded.model.config.vocab_size
    times = []
    for _ in range(repeats + 1):
        cache = kv_cache(forward(loaded.model, ids[:, :8]))
        t0 = time.perf_counter()
        forward(loaded.model, ids[:, 8:], cache, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure_hardware(loaded: LoadedModel, client: PoolClient, object_bytes: int) -> Hardware:
    """Everything the cost model needs, measured here: FLOPS_eff, the fixed cost of a forward step, each
    tier's read bandwidth and the fixed latency of a read."""
    bandwidth, latency = measure_reads(client, object_bytes)
    return Hardware(measure_flops(loaded), bandwidth, "measured on this cluster", latency, measure_step(loaded))
