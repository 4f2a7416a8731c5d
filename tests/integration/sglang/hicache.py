"""SGLang's real classes as the tests use them: host KV pools on CPU (``pin_memory=False``: pinning needs CUDA) and
the storage config its controller hands a backend.  SGLang is imported inside the helpers: a test module imports it
first through ``sglang_needed`` (a skip where it is not installed); Ray workers import this module too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")  #: those SGLang's MLA host pool points pages in
PAGE = 4  #: tokens a page (SGLang's default on GPUs is 64; small pages keep the test's pool small)
MODULE, CLASS = "kvpool.prefill_decode.sglang.storage", "KvPoolStorage"


def pools(
    layout: str, *, layers: int = 3, heads: int = 2, dim: int = 64, size: int = 64
) -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    """A real MHA device pool of ``size`` tokens on CPU and its host pool (twice as many) in ``layout``, the host
    pool filled with random bf16."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(
        size=size,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
    )
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.dtype))
    return dev, host


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
    host = MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
        target_layer_num=dev.layer_num,
    )
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.dtype))
    return dev, host


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
