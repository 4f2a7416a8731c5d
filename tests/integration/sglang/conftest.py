"""Fixtures of the SGLang tests: SGLang's real host KV pools on CPU (``pin_memory=False``: pinning needs CUDA), a
pool on the session's Ray cluster, and the extra config that points a backend at it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.servers.etcd import EmbeddedEtcd

if TYPE_CHECKING:  # SGLang is imported by each test module (sglang_needed: skipped where it is not installed)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
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


def storage_config(
    extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False
) -> HiCacheStorageConfig:
    """What SGLang's controller hands a backend (``_generate_storage_config``), with ``extra`` as the extra config."""
    return HiCacheStorageConfig(
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


@pytest.fixture
def sglang_pool(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> Iterator[PoolConfig]:
    """A pool on every node of the session's Ray cluster."""
    metadata = MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=30)
    config = PoolConfig(
        metadata=metadata, dram_bytes=64 * MiB, nvme_bytes=64 * MiB, namespace=f"sgl-{uuid.uuid4().hex[:8]}"
    )
    start_pool(config)
    yield config
    stop_pool(config)


@pytest.fixture
def extra(sglang_pool: PoolConfig) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` for a server using ``sglang_pool``."""
    return {
        "backend_name": "kvpool",
        "module_path": MODULE,
        "class_name": CLASS,
        "interface_v1": 1,
        "etcd": ",".join(sglang_pool.metadata.endpoints),
        "cluster": sglang_pool.metadata.cluster,
        "namespace": sglang_pool.namespace,
    }
