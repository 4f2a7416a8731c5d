"""kvpool's CPU connector for LMCache (``kvpool.bench.serving.lmcache_cpu``) against vLLM's own K/V view of its CPU
cache (``cpu_attn.py``: ``[B, H, 2 * N, C]``, keys in rows ``0 .. N``, values in ``N .. 2N``): stores of whole and
partial blocks, loads that skip slots below 0 and the tokens vLLM's prefix cache holds.  Needs LMCache, which ``make
test`` does not install (``make bench-peer-lmcache`` does), and vLLM's connector base class."""

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("lmcache", reason="LMCache is the serving bench's peer: make bench-peer-lmcache installs it")
pytestmark = pytest.mark.slow  # imports vLLM's connector and LMCache (20-30 s on a busy box), once for the whole run

from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

from kvpool.bench.serving.lmcache_cpu import CpuKVConnector, Run, UncopyableKV, block_runs  # noqa: E402

BLOCKS, HEADS, N, C, LAYERS = 12, 2, 8, 4, 3  # N: tokens per block, C: head size


def vllm_kv(cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value of ``slot`` in one layer, as vLLM's CPU attention reads them: each ``[H * C]``."""
    block, offset = divmod(slot, N)
    rows = cache.view(BLOCKS, HEADS, 2 * N, C)[block]
    return rows[:, offset].reshape(-1), rows[:, N + offset].reshape(-1)


def memory_obj(tokens: int, fill: torch.Tensor | None = None) -> Any:
    tensor = torch.full((2, LAYERS, tokens, HEADS * C), float("nan")) if fill is None else fill
    return SimpleNamespace(tensor=tensor, metadata=SimpleNamespace(fmt=MemoryFormat.KV_2LTD))


@pytest.fixture
def caches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(BLOCKS, HEADS, N, 2 * C) for _ in range(LAYERS)]


@pytest.fixture
def slots() -> torch.Tensor:
    """A 45-token request over shuffled blocks: five full blocks and a partial sixth."""
    blocks = torch.tensor([7, 2, 9, 0, 11, 4])
    return (blocks[:, None] * N + torch.arange(N)).reshape(-1)[:45]


def test_block_runs_split_at_block_ends_and_gaps() -> None:
    assert block_runs([8, 9, 10, 3, -1, 4, 5, 6, 7, 16], N) == [
        Run(0, 1, 0, 3),
        Run(3, 0, 3, 1),
        Run(5, 0, 4, 4),
        Run(9, 2, 0, 1),
    ]
    assert block_runs([8, 9, 10, 3], N, skip=2) == [Run(2, 1, 2, 1), Run(3, 0, 3, 1)]
    assert block_runs([-1, -1], N) == []


def test_stores_match_vllms_view(caches: list[torch.Tensor], slots: torch.Tensor) -> None:
    connector = CpuKVConnector(LAYERS, HEADS, C)
    for start, end in [(0, 16), (16, 45), (19, 21)]:  # whole blocks; a partial last block; inside one block
        out = memory_obj(end - start)
        connector.batched_from_gpu([out], [start], [end], kvcaches=caches, slot_mapping=slots)
        for layer, cache in enumerate(caches):
            for i in range(end - start):
                key, value = vllm_kv(cache, int(slots[start + i]))
                assert torch.equal(out.tensor[0, layer, i], key) and torch.equal(out.tensor[1, layer, i], value)


def test_loads_skip_vllms_prefix_and_unslotted_tokens(caches: list[torch.Tensor], slots: torch.Tensor) -> None:
    before = [c.clone() for c in caches]
    mapping = slots.clone()
    mapping[20] = -1
    src = torch.randn(2, LAYERS, 29, HEADS * C)  # tokens 16 .. 45
    connector = CpuKVConnector(LAYERS, HEADS, C)
    connector.to_gpu(memory_obj(29, src), 16, 45, kvcaches=caches, slot_mapping=mapping, vllm_cached_tokens=18)
    for layer, cache in enumerate(caches):
        for token in range(45):
            slot = int(slots[token])
            loaded = token >= 18 and token != 20
            expect = (src[0, layer, token - 16], src[1, layer, token - 16]) if loaded else vllm_kv(before[layer], slot)
            key, value = vllm_kv(cache, slot)
            assert torch.equal(key, expect[0]) and torch.equal(value, expect[1]), (layer, token)
    untouched = {int(b) for b in range(BLOCKS)} - {int(s) // N for s in slots}
    assert all(torch.equal(caches[0][b], before[0][b]) for b in untouched)


def test_a_round_trip_through_another_engines_blocks(caches: list[torch.Tensor], slots: torch.Tensor) -> None:
    connector = CpuKVConnector(LAYERS, HEADS, C)
    out = memory_obj(45)
    connector.from_gpu(out, 0, 45, kvcaches=caches, slot_mapping=slots)
    other = [torch.zeros_like(c) for c in caches]
    moved = (slots + 3) % (BLOCKS * N)  # other blocks, and runs that straddle block ends
    CpuKVConnector(LAYERS, HEADS, C).to_gpu(out, 0, 45, kvcaches=other, slot_mapping=moved)
    for layer in range(LAYERS):
        for token in range(45):
            assert all(
                map(torch.equal, vllm_kv(other[layer], int(moved[token])), vllm_kv(caches[layer], int(slots[token])))
            )


def test_what_it_cannot_copy_is_its_own_error(caches: list[torch.Tensor], slots: torch.Tensor) -> None:
    connector = CpuKVConnector(LAYERS, HEADS, C)
    mapping = slots.clone()
    mapping[3] = -1
    with pytest.raises(UncopyableKV, match="no slot"):
        connector.from_gpu(memory_obj(8), 0, 8, kvcaches=caches, slot_mapping=mapping)
    wrong = SimpleNamespace(
        tensor=torch.empty(2, LAYERS, 8, HEADS * C), metadata=SimpleNamespace(fmt=MemoryFormat.KV_T2D)
    )
    with pytest.raises(UncopyableKV, match="KV_2LTD"):
        connector.from_gpu(wrong, 0, 8, kvcaches=caches, slot_mapping=slots)
    with pytest.raises(UncopyableKV, match="layout"):
        connector.from_gpu(memory_obj(8), 0, 8, kvcaches=[c.transpose(1, 2) for c in caches], slot_mapping=slots)
    assert connector.get_shape(45) == torch.Size([2, LAYERS, 45, HEADS * C])
