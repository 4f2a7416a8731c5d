"""The device tier: watermark offload of resident KV to the pool (85 %), scratch dropped (95 %).

The CPU path runs everywhere; the same test on CUDA (pinned buffers, non-blocking copies) runs where a GPU is.
"""

from collections.abc import Iterator

import pytest
import torch

from kvpool.pool.client import PoolClient
from kvpool.prefill_decode.reference.connector import PoolConnector
from kvpool.prefill_decode.reference.device_tier import DeviceTier, Priority, cache_bytes
from kvpool.prefill_decode.reference.layout import KVLayout
from kvpool.prefill_decode.reference.model import LoadedModel, kv_cache, tiny_llama

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.fixture(params=DEVICES)
def on_device(request: pytest.FixtureRequest, model: LoadedModel) -> Iterator[LoadedModel]:
    if request.param == "cpu":
        yield model
    else:
        opts = {"layers": 8, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 512}
        yield tiny_llama(seed=0, device=request.param, **opts)  # type: ignore[arg-type]


def test_offload_at_85_percent_and_drop_scratch_at_95(on_device: LoadedModel, pd_client: PoolClient) -> None:
    model = on_device
    layout = KVLayout.of(model.model, chunk_size=32)
    connector = PoolConnector(pd_client, layout, layout.identity(f"{model.name}-device-tier"))

    def run(seed: int) -> tuple[list[int], object]:
        tokens = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
        with torch.no_grad():
            out = model.model(torch.tensor([tokens], device=model.device), use_cache=True)
        return tokens, kv_cache(out)

    runs = [run(i) for i in range(5)]
    one = cache_bytes(runs[0][1])  # type: ignore[arg-type]
    tier = DeviceTier(connector, int(3.2 * one), device=model.device)
    for i in range(3):  # 3 caches: 94 % > 85 %: the least recently used one leaves for the pool
        tier.admit(f"r{i}", runs[i][0], runs[i][1])  # type: ignore[arg-type]
    tier.drain()
    assert tier.get("r0") is None and tier.get("r1") is not None and tier.counts["offloaded"] == 1
    keys = connector.keys(runs[0][0])
    assert len(keys) == 2 and all(pd_client.exists_batch(k) for k in keys)  # its full chunks, in the pool
    assert {p.identity for ks in keys for k in ks for p in pd_client.cache.replicas(k)} == {connector.fingerprint}
    assert tier.used <= 0.85 * tier.budget

    tier.admit("s", runs[3][0], runs[3][1], Priority.SCRATCH)  # 94 % again: r1 was just read, so r2 leaves
    tier.drain()
    assert tier.get("s") is not None and tier.get("r2") is None and tier.get("r1") is not None
    big = DeviceTier(connector, int(2.05 * one), device=model.device, offload_at=0.9, drop_at=0.95)
    big.admit("s", runs[3][0], runs[3][1], Priority.SCRATCH)
    big.admit("n", runs[4][0], runs[4][1])  # 98 %: scratch goes first, without a copy
    big.drain()
    assert big.get("s") is None and big.get("n") is not None
    assert (big.counts["dropped"], big.counts["offloaded"]) == (1, 0)
    assert not any(any(pd_client.exists_batch(k)) for k in connector.keys(runs[3][0]))  # scratch never reached the pool
