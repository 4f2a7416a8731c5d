"""Helpers of the engine tests: engines in processes of their own, the prompts, a connector config for a pool."""

import time
from pathlib import Path
from typing import Any

import ray

from kvpool.pool.config import PoolConfig
from kvpool.prefill_decode.vllm.engine import EngineProcess
from kvpool.prefill_decode.vllm.zygote import Zygote

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


ENV = {"PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}  #: the engines' environment over the tests'
#: the session's zygote (conftest.py), which imported vLLM: engines of seed 0 are forked from it
ZYGOTE: list[Zygote] = []


def engine(settings: dict[str, Any], log: Path, hash_seed: int = 0) -> EngineProcess:
    """An engine in a process of its own, with its own ``PYTHONHASHSEED`` (another than 0: started afresh)."""
    env = {**ENV, "PYTHONHASHSEED": str(hash_seed)}
    return EngineProcess(settings, log, env=env, zygote=ZYGOTE[0] if ZYGOTE else None)


def reloaded(
    e: EngineProcess, tokens: list[int], hit: int, salt: str = "", timeout_s: float = 60.0
) -> tuple[dict[str, Any], dict[str, float]]:
    """``tokens`` answered by ``e`` with its own prefix cache emptied once the pool serves ``hit`` of them: the answer
    and what the connector counted for that request alone.  ``e`` saved them: it learns of its chunks through its etcd
    watch, which a loaded machine may deliver late, so it asks again until then (a miss meanwhile computes the prompt,
    and its saves find the chunks held); the answer short of ``hit`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = e.ask(connector=True)["totals"]
        [got] = e.generate([tokens], reset=True, salts=[salt] if salt else None)
        if got["cached"] >= hit or time.monotonic() > deadline:
            after = e.ask(connector=True)["totals"]
            return got, {name: value - before.get(name, 0) for name, value in after.items()}
        time.sleep(0.5)


def prompt(seed: int, n: int = 600) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 1 for i in range(n)]


#: two prompts of two full chunks and a tail each, one sharing the first prompt's chunks, and those chunks alone
P, R = prompt(1), prompt(2)
Q = P[: 2 * CHUNK] + prompt(3, 90)
S = P[: 2 * CHUNK]
