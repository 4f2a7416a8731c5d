"""``KvPoolStorage`` against SGLang's real MLA host pool (``MLATokenToKVPoolHost`` over a CPU ``MLATokenToKVPool``)
in every layout it points pages in: bytes equal both ways; the latent pages keyed without the TP rank, saved by the
storage-writer rank only and read by every rank; and never shared with an MHA server of the same model."""

from typing import Any

import pytest
import torch
from hicache import MLA_LAYOUTS, PAGE, host_pool, mla_host_pool, storage_config
from sglang_needed import sglang_module

sglang_module("sglang.srt.mem_cache.hicache_storage")  # a skip where SGLang is not installed (see sglang_needed)

from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from kvpool.prefill_decode.sglang.pages import PageLayout  # noqa: E402
from kvpool.prefill_decode.sglang.storage import KvPoolStorage  # noqa: E402


def backend(host: Any, extra: dict[str, Any], **config: Any) -> KvPoolStorage:
    store = KvPoolStorage(storage_config(extra, **config), {})
    store.register_mem_pool_host(host)
    return store


def pages_of(host: Any, slots: torch.Tensor) -> list[torch.Tensor]:
    """The pages at host ``slots`` in the pool object's order (``[layers, page, kv_cache_dim]``)."""
    layout = PageLayout(host)
    return [layout.view(int(s)).reshape(layout.layers, PAGE, layout.dim).clone() for s in slots[::PAGE]]


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_round_trip_in_every_layout(layout: str, extra: dict[str, Any]) -> None:
    host = mla_host_pool(layout)
    store = backend(host, extra, mla=True)
    try:
        assert store.pages is not None and store.pages.shape == (1, 3, PAGE, 1, 64 + 16)
        keys = get_hash_str(list(range(200, 200 + 4 * PAGE)), None, page_size=PAGE)
        slots = host.alloc(4 * PAGE)
        saved = pages_of(host, slots)
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys, slots) == [True] * 4
        assert store.batch_exists(keys) == 4
        into = host.alloc(4 * PAGE)
        assert store.batch_get_v1(keys, into) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages_of(host, into), saved, strict=True))
        for i, s in enumerate(into[::PAGE].tolist()):  # SGLang's own flat pages agree
            assert torch.equal(host.get_data_page(s), host.get_data_page(int(slots[i * PAGE])))
        # the generic path's flat pages are the same objects under the same keys
        got = store.batch_get(keys[:2], [host.get_dummy_flat_data_page() for _ in range(2)])
        assert all(
            g is not None and torch.equal(g, host.get_data_page(int(slots[i * PAGE]))) for i, g in enumerate(got)
        )
    finally:
        store.close()


def test_one_rank_writes_and_every_rank_reads_the_one_copy(extra: dict[str, Any]) -> None:
    """Two TP ranks of one MLA server (each its own host pool, different layouts to show the pages' order is one):
    rank 1's backup writes nothing and says it saved; rank 0's pages load into both, and into a TP=1 server."""
    keys = get_hash_str(list(range(600, 600 + 3 * PAGE)), None, page_size=PAGE)
    rank0_host, rank1_host = mla_host_pool("page_first"), mla_host_pool("layer_first")
    rank0 = backend(rank0_host, extra, mla=True, tp_rank=0, tp_size=2)
    rank1 = backend(rank1_host, extra, mla=True, tp_rank=1, tp_size=2)
    try:
        assert rank0.root == rank1.root  # no TP rank or size in an MLA page's key
        assert rank1.batch_set_v1(keys, rank1_host.alloc(3 * PAGE)) == [True] * 3
        assert rank1.batch_set(keys, [rank1_host.get_dummy_flat_data_page() for _ in keys]) is True
        assert rank0.batch_exists(keys) == 0 and not rank1.counts.totals.get("saved_tokens")  # nothing written
        slots = rank0_host.alloc(3 * PAGE)
        saved = pages_of(rank0_host, slots)
        assert rank0.batch_set_v1(keys, slots) == [True] * 3
        for store, host in ((rank0, rank0_host), (rank1, rank1_host)):
            assert store.batch_exists(keys) == 3
            into = host.alloc(3 * PAGE)
            assert store.batch_get_v1(keys, into) == [True] * 3
            assert all(torch.equal(a, b) for a, b in zip(pages_of(host, into), saved, strict=True))
    finally:
        rank0.close()
        rank1.close()
    single_host = mla_host_pool("page_first_direct")
    single = backend(single_host, extra, mla=True)
    try:
        into = single_host.alloc(3 * PAGE)
        assert single.batch_get_v1(keys, into) == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(pages_of(single_host, into), saved, strict=True))
    finally:
        single.close()


def test_mla_pages_are_not_shared_with_an_mha_server(extra: dict[str, Any]) -> None:
    keys = get_hash_str(list(range(900, 900 + 2 * PAGE)), None, page_size=PAGE)
    host = mla_host_pool("page_first")
    mla = backend(host, extra, mla=True)
    try:
        assert all(mla.batch_set_v1(keys, host.alloc(2 * PAGE)))
    finally:
        mla.close()
    mha = backend(host_pool("page_first"), extra)
    try:
        assert mha.root != mla.root and mha.batch_exists(keys) == 0
    finally:
        mha.close()
