"""Two SGLang servers' storage sides on two Ray nodes, each with its own host pool and ``KvPoolStorage``: the pages
one backs up, the other finds and loads from the pool over the transfer engine (one-sided reads from the first
node's pool node; no KV byte through Ray), bytes equal."""

import hashlib
import os
from pathlib import Path
from typing import Any

import ray
import sglang_needed
import torch
from hicache import PAGE, host_pool, storage_config
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from sglang_needed import sglang_module

sglang_module("sglang.srt.mem_cache.hicache_storage")  # a skip where SGLang is not installed (see sglang_needed)

from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvpool.prefill_decode.sglang.pages import PageLayout  # noqa: E402
from kvpool.prefill_decode.sglang.storage import KvPoolStorage  # noqa: E402


def digests(host: MHATokenToKVPoolHost, slots: torch.Tensor) -> list[str]:
    """The SHA-256 of each page at host ``slots``, in the pool object's order (what is compared across nodes)."""
    layout = PageLayout(host)
    return [
        hashlib.sha256(layout.view(int(s)).contiguous().view(torch.uint8).numpy()).hexdigest() for s in slots[::PAGE]
    ]


@ray.remote(num_cpus=0)
class Server:
    """The storage side of an SGLang server on another Ray node: its own host pool (``layout``) and backend."""

    def __init__(self, extra: dict[str, Any], layout: str) -> None:
        sglang_module("sglang.srt.mem_cache.hicache_storage")  # this worker's torchvision, as the driver's
        self.host = host_pool(layout)
        self.store = KvPoolStorage(storage_config(extra), {})
        self.store.register_mem_pool_host(self.host)

    def load(self, hashes: list[str]) -> tuple[int, list[bool], list[str], str]:
        """How many leading pages the pool holds, which loaded, their digests, and this node's id."""
        held = self.store.batch_exists(hashes)
        slots = self.host.alloc(len(hashes) * PAGE)
        ok = self.store.batch_get_v1(hashes, slots)
        return held, ok, digests(self.host, slots), ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.store.close()


def test_pages_one_server_backs_up_another_loads_on_another_node(extra: dict[str, Any], ray_cluster: list[str]) -> None:
    host = host_pool("page_first")
    writer = KvPoolStorage(storage_config(extra), {})
    writer.register_mem_pool_host(host)
    try:
        tokens = list(range(300, 300 + 8 * PAGE))
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        slots = host.alloc(len(tokens))
        assert writer.batch_set_v1(hashes, slots) == [True] * 8
        here = ray.get_runtime_context().get_node_id()
        cache = writer.connection.connected.cache
        assert {p.node for k in writer.keys(hashes) for p in cache.replicas(k)} == {here}
        other = next(n for n in ray_cluster if n != here)
        # the worker imports this module, and with it hicache and sglang_needed: their folders on its path
        paths = (str(Path(__file__).parent), str(Path(sglang_needed.__file__).parent), os.environ.get("PYTHONPATH", ""))
        env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        server = Server.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False), runtime_env={"env_vars": env}
        ).remote(extra, "page_head")
        try:
            held, ok, got, node = ray.get(server.load.remote(hashes), timeout=180)
            assert node == other and held == 8 and ok == [True] * 8
            assert got == digests(host, slots)
        finally:
            ray.get(server.close.remote(), timeout=60)
            ray.kill(server)
    finally:
        writer.close()
