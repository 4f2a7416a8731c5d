"""SGLang's real classes as the tests use them: host KV pools on CPU (``pin_memory=False``: pinning needs CUDA), the
storage config its controller hands a backend, and its ``HiCacheController`` driven as a server's radix cache drives
it (:func:`attached`, :func:`back_up`, :func:`prefetch`).  SGLang is imported inside the helpers: a test module imports
it first through ``sglang_needed`` (a skip where it is not installed); Ray workers import this module too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")  #: those SGLang's MLA host pool points pages in
PAGE = 4  #: tokens a page (SGLang's default on GPUs is 64; small pages keep the test's pool small)
WAIT_S = 60  #: how long a controller's queue is waited on
MODULE, CLASS = "kvpool.prefill_decode.sglang.storage", "KvPoolStorage"


def pools(
    layout: str, *, layers: int = 3, heads: int = 2, dim: int = 64, size: int = 64, page: int = PAGE
) -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    """A real MHA device pool of ``size`` tokens on CPU and its host pool (twice as many) in ``layout``, ``page``
    tokens a page, the host pool filled with random bf16."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(
        size=size,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    return dev, _host(MHATokenToKVPoolHost, dev, page, layout)


def _host(cls: Any, dev: Any, page: int, layout: str, **extra: Any) -> Any:
    """SGLang's host pool ``cls`` (twice ``dev``'s tokens) on CPU in ``layout``, filled with random bf16."""
    import torch

    host = cls(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
        **extra,
    )
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.dtype))
    return host


def host_pool(layout: str, **dims: int) -> MHATokenToKVPoolHost:
    """A real MHA host pool in ``layout`` (see :func:`pools`)."""
    return pools(layout, **dims)[1]


def mla_pools(
    layout: str, *, layers: int = 3, lora: int = 64, rope: int = 16, size: int = 64
) -> tuple[MLATokenToKVPool, MLATokenToKVPoolHost]:
    """A real MLA device pool of ``size`` tokens on CPU (latent rows ``lora + rope`` wide) and its host pool (twice
    as many) in ``layout``, the host pool filled with random bf16."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = MLATokenToKVPool(
        size=size,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=lora,
        qk_rope_head_dim=rope,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    return dev, _host(MLATokenToKVPoolHost, dev, PAGE, layout, target_layer_num=dev.layer_num)


def mla_host_pool(layout: str, **dims: int) -> MLATokenToKVPoolHost:
    """A real MLA host pool in ``layout`` (see :func:`mla_pools`)."""
    return mla_pools(layout, **dims)[1]


def storage_config(
    extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False
) -> HiCacheStorageConfig:
    """What SGLang's controller hands a backend (``_generate_storage_config``), with ``extra`` as the extra config."""
    from sglang.srt.mem_cache import hicache_storage

    return hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="tiny-llama",
        extra_config=dict(extra),
    )


@contextlib.contextmanager
def attached(
    group: Any, extra: dict[str, Any], layout: str = "page_first", *, mla: bool = False, **dims: int
) -> Iterator[HiCacheController]:
    """A controller over its own MHA (``mla``: MLA) host pool in ``layout`` (``dims``: as :func:`pools` takes them)
    with the pool as its L3 (``interface_v1``: the zero-copy calls), detached and its backend closed on leaving."""
    import threading

    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    dev, host = mla_pools(layout, **dims) if mla else pools(layout, **dims)
    allocator = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, need_sort=False)
    ctrl = HiCacheController(
        allocator,
        host,
        PAGE,
        group,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend="dynamic",
        model_name="tiny-llama",
        storage_backend_extra_config=dict(extra),
    )
    try:
        yield ctrl
    finally:
        backend = ctrl.storage_backend
        ctrl.detach_storage_backend()  # closes the backend, unless SGLang's failure injector wraps it
        getattr(backend, "_backend", backend).close()


def back_up(ctrl: HiCacheController, tokens: list[int]) -> tuple[list[torch.Tensor], int]:
    """Write ``tokens``' pages (random host bytes) to storage as a server does once they are in host memory (keyed
    as its radix cache keys them: the storage chain); the pages (in the pool object's order) and how many tokens the
    backup thread says it saved."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvpool.prefill_decode.sglang.pages import PageLayout

    host = ctrl.mem_pool_host
    slots = host.alloc(len(tokens))
    layout = PageLayout(host)
    saved = [layout.view(int(s)).clone() for s in slots[::PAGE]]
    op_id = ctrl.write_storage(slots, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
    done = ctrl.ack_backup_queue.get(timeout=WAIT_S)
    assert done.id == op_id
    host.free(slots)
    return saved, done.completed_tokens


def prefetch(ctrl: HiCacheController, tokens: list[int], req: str) -> list[torch.Tensor]:
    """Prefetch ``tokens`` as the radix cache does (the hit query, host slots for the hit, the I/O, the ack); the
    pages that arrived, in the pool object's order."""
    from kvpool.prefill_decode.sglang.pages import PageLayout

    ctrl.prefetch(req, tokens, None, None)
    hit = ctrl.prefetch_hit_queue.get(timeout=WAIT_S)
    if hit.storage_hit_count == 0:
        return []
    host = ctrl.mem_pool_host
    hit.host_indices = host.alloc(hit.storage_hit_count)
    ctrl.prefetch_buffer.put(hit)
    completed = 0
    while True:  # progress acks (the tokens loaded so far, every rank agreeing), then the last one
        ack = ctrl.ack_prefetch_queue.get(timeout=WAIT_S)
        if ack.completed_tokens is not None:
            completed = max(completed, ack.completed_tokens)
        if ack.completed_req:
            break
    assert completed <= hit.storage_hit_count
    layout = PageLayout(host)
    got = [layout.view(int(s)).clone() for s in hit.host_indices[:completed:PAGE]]
    host.free(hit.host_indices)
    return got
