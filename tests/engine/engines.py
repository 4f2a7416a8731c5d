"""Helpers of the engine tests: engines in processes of their own, the prompts, a connector config for a pool."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray

from kvpool.pool.config import PoolConfig

ENGINE_PROC = Path(__file__).with_name("engine_proc.py")
CHUNK = 256  #: tokens per pool chunk in these tests (8 of vLLM's 32-token blocks)


def extra_config(pool: PoolConfig, node_ip: str = "127.0.0.2", **overrides: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for an engine on ``node_ip`` using ``pool``."""
    return {
        "etcd": list(pool.metadata.endpoints), "cluster": pool.metadata.cluster, "namespace": pool.namespace,
        "ray_address": ray.get_runtime_context().gcs_address, "node_ip": node_ip, "model_id": "tiny-llama-vllm-test",
        "chunk_size": CHUNK, **overrides,
    }  # fmt: skip


class Engine:
    """A vLLM engine in its own process (``engine_proc.py``), answering commands one at a time."""

    def __init__(self, settings: dict[str, Any], log: Path, hash_seed: int = 0) -> None:
        env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
        self.log = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE_PROC), json.dumps(settings)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )  # fmt: skip
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(
            f"engine exited ({self.proc.wait()}) before {prefix}; its log:\n{self.log.read_text()[-6000:]}"
        )

    def ask(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def generate(self, prompts: list[list[int]], reset: bool = False) -> list[dict[str, Any]]:
        return self.ask(generate=prompts, reset=reset)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prompt(seed: int, n: int = 600) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 1 for i in range(n)]


#: two prompts of two full chunks and a tail each, and one sharing the first prompt's chunks
P, R = prompt(1), prompt(2)
Q = P[: 2 * CHUNK] + prompt(3, 90)
