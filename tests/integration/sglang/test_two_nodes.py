"""Two SGLang instances on two Ray nodes, each a real ``HiCacheController`` with its own host pool and
``KvPoolStorage`` in its own process: the pages one instance's backup thread saves, the other's prefetch threads find
and load from the pool over the transfer engine (one-sided reads from the first node's pool node; no KV byte through
Ray), bytes equal.  The writer's ``page_first`` pages go through its staging buffer (their runs are short); the
reader's ``page_first_direct`` pages land in their host slots themselves: the first prefetch through the client's
staging buffer and one checked copy, the next (the host buffer registered by then) by READs into the slots."""

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

import ray
import sglang_needed
import torch
from hicache import PAGE, attached, back_up, prefetch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from sglang_needed import sglang_module

from kvpool.prefill_decode.sglang.cpu_import import tp_group

sglang_module("sglang.srt.mem_cache.hicache_storage")  # a skip where SGLang is not installed (see sglang_needed)

from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

TOKENS = list(range(300, 300 + 8 * PAGE))
#: heads and head size of both instances' host pools: page_first_direct pages of PAGE tokens lie in runs of 24 KiB
#: (at least MIN_RUN), so the reader's move straight into its host slots
DIMS = {"heads": 8, "dim": 128}


def digests(pages: list[torch.Tensor]) -> list[str]:
    """The SHA-256 of each page (in the pool object's order): what is compared across nodes."""
    return [hashlib.sha256(p.contiguous().view(torch.uint8).numpy()).hexdigest() for p in pages]


@ray.remote(num_cpus=0)
class Instance:
    """An SGLang instance's cache side on a Ray node: its TP group, its host pool (``layout``) and its controller with
    the pool as L3."""

    def __init__(self, extra: dict[str, Any], layout: str) -> None:
        sglang_module("sglang.srt.mem_cache.hicache_storage")  # this worker's torchvision, as the driver's
        self.node = ray.get_runtime_context().get_node_id()
        self.stack = contextlib.ExitStack()
        self.ctrl = self.stack.enter_context(attached(tp_group(), extra, layout, **DIMS))

    def back_up(self, tokens: list[int]) -> tuple[int, list[str], set[str], str]:
        """Back ``tokens`` up through the backup thread: the tokens it saved, the pages' digests, the nodes that hold
        them, and this node's id."""
        saved, done = back_up(self.ctrl, tokens)
        store = self.ctrl.storage_backend
        keys = store.keys(get_storage_hash_str(tokens, None, page_size=PAGE))
        held = {p.node for k in keys for p in store.connection.connected.cache.replicas(k)}
        return done, digests(saved), held, self.node

    def prefetch(self, tokens: list[int], req: str) -> tuple[list[str], str]:
        """Prefetch ``tokens`` through the prefetch threads: the digests of the pages that came, and this node's id."""
        return digests(prefetch(self.ctrl, tokens, req)), self.node

    def staged(self) -> tuple[bool, bool]:
        """Whether the backend made its staging buffer, and whether its host buffer is registered with the
        transport."""
        store = self.ctrl.storage_backend
        return store._staging._buffer is not None, store._host.registered

    def close(self) -> None:
        self.stack.close()


def test_one_instance_backs_up_another_prefetches_on_another_node(
    extra: dict[str, Any], ray_cluster: list[str]
) -> None:
    # the workers import this module, and with it hicache and sglang_needed: their folders on their path
    paths = (str(Path(__file__).parent), str(Path(sglang_needed.__file__).parent), os.environ.get("PYTHONPATH", ""))
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    a, b = ray_cluster[1], ray_cluster[2]  # two nodes, neither the driver's
    writer, reader = (
        Instance.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), runtime_env={"env_vars": env}
        ).remote(extra, layout)
        for node, layout in ((a, "page_first"), (b, "page_first_direct"))
    )
    try:
        done, saved, held, node = ray.get(writer.back_up.remote(TOKENS), timeout=180)
        assert node == a and done == len(TOKENS) and held == {a}  # saved on the writer's node only
        assert ray.get(writer.staged.remote(), timeout=60)[0]  # page_first's runs are short: staged
        got, node = ray.get(reader.prefetch.remote(TOKENS, "req-1"), timeout=180)
        assert node == b and got == saved
        got, _ = ray.get(reader.prefetch.remote(TOKENS, "req-2"), timeout=180)  # READs into the registered host pool
        assert got == saved
        assert ray.get(reader.staged.remote(), timeout=60) == (False, True)  # no page through the staging copy
    finally:
        ray.get([writer.close.remote(), reader.close.remote()], timeout=60)
        ray.kill(writer)
        ray.kill(reader)
