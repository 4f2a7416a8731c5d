"""``KvPoolStorage`` against SGLang's real host KV pools in every layout (level 1) and loaded through SGLang's real
``dynamic`` backend factory (level 2), over a real pool on the session's Ray cluster: bytes equal both ways."""

import time
import uuid
from typing import Any

import pytest
import torch
from hicache import LAYOUTS, PAGE, host_pool, mla_host_pool, storage_config
from sglang_needed import sglang_module

from kvpool.errors import ConfigError
from kvpool.pool.config import PoolConfig
from kvpool.pool.node import stop_pool

sglang_module("sglang.srt.mem_cache.hicache_storage")  # a skip where SGLang is not installed (see sglang_needed)

from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from kvpool.prefill_decode.sglang.pages import PageLayout  # noqa: E402
from kvpool.prefill_decode.sglang.storage import KvPoolStorage  # noqa: E402


def backend(host: MHATokenToKVPoolHost, extra: dict[str, Any], **config: Any) -> KvPoolStorage:
    store = KvPoolStorage(storage_config(extra, **config), {})
    store.register_mem_pool_host(host)
    return store


def prompt(pages: int, first: int = 100) -> tuple[list[int], list[str]]:
    """Tokens of ``pages`` pages and SGLang's page hashes of them (its own chain function)."""
    tokens = list(range(first, first + pages * PAGE))
    return tokens, get_hash_str(tokens, None, page_size=PAGE)


def pages_of(host: MHATokenToKVPoolHost, slots: torch.Tensor) -> list[torch.Tensor]:
    """The pages at host ``slots``, each in the pool object's order (comparable across layouts)."""
    layout = PageLayout(host)
    return [layout.view(int(s)).clone() for s in slots[::PAGE]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_in_every_layout(layout: str, extra: dict[str, Any]) -> None:
    host = host_pool(layout)
    store = backend(host, extra)
    try:
        _, keys = prompt(5)
        slots = host.alloc(5 * PAGE)
        saved = pages_of(host, slots)
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys, slots) == [True] * 5
        assert store.batch_exists(keys) == 5
        into = host.alloc(5 * PAGE)
        assert store.batch_get_v1(keys, into) == [True] * 5
        assert all(torch.equal(a, b) for a, b in zip(pages_of(host, into), saved, strict=True))
        # the flat pages SGLang's generic path reads are the same bytes too
        for i, s in enumerate(into[::PAGE].tolist()):
            assert torch.equal(host.get_data_page(s), host.get_data_page(int(slots[i * PAGE])))
        # a partial hit: a page never stored ends the prefix, and loads as a miss (False), not an error
        _, other = prompt(1, first=9000)
        assert store.batch_exists([*keys[:2], other[0], *keys[3:]]) == 2
        assert store.batch_get_v1([keys[0], other[0]], host.alloc(2 * PAGE)) == [True, False]
        assert store.counts.totals["miss_read_failed"] == 1
        assert store.counts.totals["saved_tokens"] == 5 * PAGE
        stats = store.get_stats()  # SGLang's StorageMetrics (--enable-storage-metrics): pages and GiB/s per batch
        assert stats.backup_pgs == [5] and stats.prefetch_pgs == [5, 1] and min(stats.prefetch_bandwidth) > 0
        assert store.get_stats().backup_pgs == []  # each batch told once
    finally:
        store.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_long_pages_are_read_straight_into_the_host_slots(layout: str, extra: dict[str, Any]) -> None:
    """64-token pages lie in runs of host memory long enough (``MIN_RUN``) in these layouts: a save gathers each
    page from those runs into the pool node's segment, and a load copies it back straight into them, each checksummed
    as it lands, neither through the staging buffer; the runs hold the page's bytes in the pool object's order."""
    page = 64
    host = host_pool(layout, size=256, page=page)
    store = backend(host, extra)
    try:
        keys = get_hash_str(list(range(700, 700 + 3 * page)), None, page_size=page)
        slots, view = host.alloc(3 * page), PageLayout(host).view
        runs = store.pages.runs(view(int(slots[0])))
        assert runs is not None and len(runs) == (2 if layout == "page_first_direct" else 2 * 3)
        assert b"".join(runs) == view(int(slots[0])).contiguous().view(torch.uint8).numpy().tobytes()
        saved = [view(int(s)).clone() for s in slots[::page]]
        assert store.batch_set_v1(keys, slots) == [True] * 3
        into = host.alloc(3 * page)
        assert store.batch_get_v1(keys, into) == [True] * 3
        assert all(torch.equal(view(int(s)), b) for s, b in zip(into[::page], saved, strict=True))
        assert store._staging._buffer is None  # no page went through staging, either way: it was never made
    finally:
        store.close()


def test_servers_with_different_layouts_share_pages(extra: dict[str, Any]) -> None:
    """The pool object is one order whatever the host layout: a page_first server's pages load into the others."""
    writer_host = host_pool("page_first")
    writer = backend(writer_host, extra)
    _, keys = prompt(3)
    slots = writer_host.alloc(3 * PAGE)
    saved = pages_of(writer_host, slots)
    assert all(writer.batch_set_v1(keys, slots))
    writer.close()
    for layout in ("layer_first", "page_first_direct", "page_head"):
        host = host_pool(layout)
        reader = backend(host, extra)
        try:
            assert reader.batch_exists(keys) == 3, layout
            into = host.alloc(3 * PAGE)
            assert reader.batch_get_v1(keys, into) == [True] * 3
            assert all(torch.equal(a, b) for a, b in zip(pages_of(host, into), saved, strict=True)), layout
        finally:
            reader.close()


def test_generic_path_flat_pages(extra: dict[str, Any]) -> None:
    """Without interface_v1 SGLang saves flat data pages and loads into dummy ones: same keys, same bytes."""
    host = host_pool("page_head")
    store = backend(host, {**extra, "interface_v1": 0})
    try:
        _, keys = prompt(3)
        slots = host.alloc(3 * PAGE)
        flats = [host.get_data_page(int(s)) for s in slots[::PAGE]]
        assert store.batch_set(keys, flats) is True
        assert store.exists(keys[0]) and store.batch_exists(keys) == 3
        got = store.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
        assert all(g is not None and torch.equal(g, f) for g, f in zip(got, flats, strict=True))
        _, other = prompt(1, first=7000)
        assert store.get(other[0]) is None
        into = host.alloc(3 * PAGE)  # what a v1 server of the same model reads back
        assert store.batch_get_v1(keys, into) == [True] * 3
        assert all(torch.equal(host.get_data_page(int(s)), f) for s, f in zip(into[::PAGE], flats, strict=True))
    finally:
        store.close()


def test_pages_of_other_models_and_ranks_are_not_shared(extra: dict[str, Any]) -> None:
    host = host_pool("page_first")
    store = backend(host, extra)
    _, keys = prompt(2)
    assert all(store.batch_set_v1(keys, host.alloc(2 * PAGE)))
    store.close()
    for other in ({"model_id": "another-model"}, {"tp_rank": 1, "tp_size": 2}):
        model = {"model_id": other["model_id"]} if "model_id" in other else {}
        ranks = {k: v for k, v in other.items() if k != "model_id"}
        peer = backend(host_pool("page_first"), {**extra, **model}, **ranks)
        try:
            assert peer.batch_exists(keys) == 0, other
        finally:
            peer.close()


def test_loaded_through_sglangs_dynamic_factory(extra: dict[str, Any]) -> None:
    host = host_pool("page_first_direct")
    store = StorageBackendFactory.create_backend("dynamic", storage_config(extra), host)
    assert isinstance(store, KvPoolStorage)
    store.register_mem_pool_host(host)
    try:
        _, keys = prompt(4)
        slots = host.alloc(4 * PAGE)
        assert all(store.batch_set_v1(keys, slots))
        into = host.alloc(4 * PAGE)
        assert store.batch_get_v1(keys, into) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages_of(host, into), pages_of(host, slots), strict=True))
    finally:
        store.close()


def test_a_pool_that_goes_down_gives_misses(extra: dict[str, Any], sglang_pool: PoolConfig) -> None:
    host = host_pool("page_first")
    store = backend(host, extra)
    try:
        _, keys = prompt(3)
        assert all(store.batch_set_v1(keys, host.alloc(3 * PAGE)))
        stop_pool(sglang_pool)
        deadline = time.monotonic() + 30
        while store.batch_exists(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.batch_exists(keys) == 0
        assert store.batch_get_v1(keys, host.alloc(3 * PAGE)) == [False] * 3
        assert store.batch_set_v1(keys, host.alloc(3 * PAGE)) == [False] * 3
        assert store.counts.totals["save_errors"] >= 3
    finally:
        store.close()


def test_no_pool_at_all_gives_misses_at_once(extra: dict[str, Any]) -> None:
    """etcd does not answer: lookups are 0 held, loads and saves fail per page; nothing raises into SGLang."""
    host = host_pool("layer_first")
    store = backend(host, {**extra, "etcd": "127.0.0.1:9", "cluster": f"t-{uuid.uuid4().hex[:12]}"})
    try:
        _, keys = prompt(2)
        assert store.batch_set_v1(keys, host.alloc(2 * PAGE)) == [False, False]
        assert store.batch_exists(keys) == 0
        started = time.monotonic()
        assert store.batch_get_v1(keys, host.alloc(2 * PAGE)) == [False, False]
        assert time.monotonic() - started < 1  # no new attempt before RETRY_S
        assert store.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None, None]
        assert "etcd" in store.connection.error or "127.0.0.1:9" in store.connection.error
    finally:
        store.close()


def test_what_it_cannot_serve_is_refused_when_attached(extra: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="chunk_siz"):
        KvPoolStorage(storage_config({**extra, "chunk_siz": 64}), {})
    refused = [
        (False, host_pool("page_unified"), "MHA host pools .* 'page_unified' .*get_page_buffer_meta"),
        (
            True,
            mla_host_pool("page_unified"),
            "MLA host pools in the layouts layer_first, page_first, page_first_direct",
        ),
        (False, mla_host_pool("page_first"), "is_mla_model=False but the host pool is MLATokenToKVPoolHost"),
    ]
    for mla, host, why in refused:
        store = KvPoolStorage(storage_config(extra, mla=mla), {})
        try:
            with pytest.raises(ConfigError, match=why):
                store.register_mem_pool_host(host)
        finally:
            store.close()


def test_sglang_makes_no_page_first_kv_split_host_pool_on_cpu() -> None:
    """Why KvPoolStorage refuses page_first_kv_split (pages.REFUSED): SGLang builds it only from an Ascend NPU's
    split MLA buffers; its CPU MLA host pool fails to make one, and its MHA host pool has no such layout."""
    with pytest.raises(AttributeError, match="index_layer_indices"):
        mla_host_pool("page_first_kv_split")
    with pytest.raises(ValueError, match="Unsupported layout: page_first_kv_split"):
        host_pool("page_first_kv_split")
