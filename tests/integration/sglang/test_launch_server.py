"""SGLang's own server end to end on the pool (GPU hosts only): ``python -m sglang.launch_server`` started with the
flags ``kvpool sglang-config`` prints, twice.  The first server computes a prompt and its backup thread saves the
pages into the pool; a fresh second server finds them there (``cached_tokens_details["storage"]``) and answers with
the same tokens.

Skipped without CUDA: SGLang's engine does not start on CPU-only machines like this project's (its CPU kernels,
``sglang-kernel-cpu``, are not on the package registry; ``docs/sglang.md``).  The backend itself is tested on CPU
through SGLang's own host pools and controller (test_storage.py, test_controller.py, test_two_nodes.py)."""

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from http_asks import health
from sglang_needed import sglang_module

from kvpool.core.net import free_port
from kvpool.errors import WorkerUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import ENDPOINTS_ENV
from kvpool.metadata.namespace import Namespace
from kvpool.pool.config import PoolConfig
from kvpool.servers.process import ServerProcess

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: SGLang's engine does not start on these CPUs (its CPU kernels, sglang-kernel-cpu, are "
    "not on the package registry); the backend is tested on CPU through SGLang's host pools and controller",
)

PAGE = 64  #: SGLang's page on GPUs, and so the pool object's tokens
PROMPT = 16 * PAGE  #: prompt tokens: above SGLang's prefetch threshold (256)
KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def pool_flags(pool: PoolConfig) -> list[str]:
    """The flags ``kvpool sglang-config`` prints for ``pool``, as a user gets them (the session's Ray cluster named
    by its GCS address and head node IP, for a server in a process of its own)."""
    head_ip = min(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    where = ["--etcd", pool.metadata.endpoints[0], "--cluster", pool.metadata.cluster, "--namespace", pool.namespace]
    ray_args = ["--ray-address", ray.get_runtime_context().gcs_address, "--node-ip", head_ip]
    out = subprocess.run(
        [sys.executable, KVPOOL, "sglang-config", *where, *ray_args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout)


def serve(model: Path, flags: list[str], log: Path) -> tuple[ServerProcess, str]:
    """``python -m sglang.launch_server`` on ``model`` with the pool's ``flags`` (and the user's own: where to listen,
    a small share of the GPU, token ids in and out); its URL once it serves."""
    port = free_port("127.0.0.1")
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--served-model-name",
        "tiny-llama",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--page-size",
        str(PAGE),
        "--mem-fraction-static",
        "0.2",
        "--disable-cuda-graph",
        "--hicache-mem-layout",
        "page_first",
        "--hicache-write-policy",
        "write_through",
        "--hicache-storage-prefetch-policy",
        "wait_complete",
        "--random-seed",
        "0",
        *flags,
    ]
    env = {k: v for k, v in os.environ.items() if k not in (ENDPOINTS_ENV, "RAY_ADDRESS")}
    server = ServerProcess("SGLang's server", args, log, env=env, grace_s=30)
    url = f"http://127.0.0.1:{port}"
    server.start(lambda: health(url), 900, WorkerUnavailable, poll_s=1.0)
    return server, url


def generate(url: str, tokens: list[int]) -> dict[str, Any]:
    """Greedy tokens after ``tokens`` (SGLang's native /generate, token ids in and out), with its meta info."""
    body = {"input_ids": tokens, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    ask = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=300) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def pages_held(pool: PoolConfig) -> int:
    """The objects the pool holds now (one a saved page)."""
    etcd = EtcdClient(pool.metadata)
    try:
        with MetadataCache(etcd, Namespace(pool.metadata.cluster)) as cache:
            cache.sync()
            return cache.chunk_count()
    finally:
        etcd.close()


@pytest.mark.timeout(2400)
def test_a_fresh_server_loads_the_pages_another_saved_and_answers_the_same(
    sglang_pool: PoolConfig, tmp_path: Path
) -> None:
    sglang_module("sglang.srt.entrypoints.http_server")  # a skip where SGLang is not installed (see sglang_needed)
    from kvpool.prefill_decode.reference.model import tiny_llama

    model = tmp_path / "tiny-llama"
    tiny_llama(layers=4, hidden=256, heads=4, kv_heads=2, vocab=4096).model.save_pretrained(model)
    flags = pool_flags(sglang_pool)
    prompt = [(7 * i + 3) % 4000 + 10 for i in range(PROMPT)]
    full = (PROMPT - 1) // PAGE * PAGE  #: the prompt's pages a server can take from a cache (not the last token)

    first, url = serve(model, flags, tmp_path / "first.log")
    try:
        cold = generate(url, prompt)
        assert not (cold["meta_info"].get("cached_tokens_details") or {}).get("storage")
        deadline = time.monotonic() + 120  # the backup thread saves after the answer
        while pages_held(sglang_pool) < full // PAGE and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pages_held(sglang_pool) >= full // PAGE, "the first server's pages never reached the pool"
    finally:
        first.stop()

    fresh, url = serve(model, flags, tmp_path / "fresh.log")
    try:
        warm = generate(url, prompt)
    finally:
        fresh.stop()
    details = warm["meta_info"]["cached_tokens_details"]
    assert details["storage_backend"] == "KvPoolStorage" and details["storage"] == full, details
    assert warm["output_ids"] == cold["output_ids"]
