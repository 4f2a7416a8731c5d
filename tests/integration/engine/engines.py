"""Helpers of the engine tests: engines in processes of their own, the prompts, a connector config for a pool."""

from pathlib import Path
from typing import Any

import ray

from kvpool.pool.config import PoolConfig
from kvpool.prefill_decode.vllm.engine import EngineProcess

CHUNK = 256  #: tokens per pool chunk in these tests (8 of vLLM's 32-token blocks)


def extra_config(pool: PoolConfig, node_ip: str = "127.0.0.2", **overrides: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for an engine on ``node_ip`` using ``pool``."""
    return {
        "etcd": list(pool.metadata.endpoints),
        "cluster": pool.metadata.cluster,
        "namespace": pool.namespace,
        "ray_address": ray.get_runtime_context().gcs_address,
        "node_ip": node_ip,
        "model_id": "tiny-llama-vllm-test",
        "chunk_size": CHUNK,
        **overrides,
    }


def engine(settings: dict[str, Any], log: Path, hash_seed: int = 0) -> EngineProcess:
    """An engine in a process of its own, with its own ``PYTHONHASHSEED``."""
    return EngineProcess(settings, log, env={"PYTHONHASHSEED": str(hash_seed), "VLLM_CPU_KVCACHE_SPACE": "1"})


def prompt(seed: int, n: int = 600) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 1 for i in range(n)]


#: two prompts of two full chunks and a tail each, one sharing the first prompt's chunks, and those chunks alone
P, R = prompt(1), prompt(2)
Q = P[: 2 * CHUNK] + prompt(3, 90)
S = P[: 2 * CHUNK]
