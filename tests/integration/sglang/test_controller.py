"""``KvPoolStorage`` under SGLang's real ``HiCacheController`` (level 3): its backup thread saves pages through
``batch_set_v1``, its prefetch threads find them (``batch_exists``) and load them into new host slots
(``batch_get_v1``), as a server's radix cache drives them; with SGLang's own failure injector, every prefetch gives
the right bytes or a miss."""

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hicache import PAGE, pools
from sglang_needed import sglang_module

sglang_module("sglang.srt.mem_cache.hicache_storage")  # a skip where SGLang is not installed (see sglang_needed)

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from kvpool.prefill_decode.sglang.pages import PageLayout  # noqa: E402
from kvpool.prefill_decode.sglang.storage import KvPoolStorage  # noqa: E402

WAIT_S = 60


@pytest.fixture(scope="module")
def tp_group() -> Any:
    """SGLang's TP group of one rank (gloo on loopback), as its scheduler sets it up."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    return dist.new_group([0], backend="gloo")


@contextlib.contextmanager
def attached(tp_group: Any, extra: dict[str, Any], layout: str = "page_first") -> Iterator[HiCacheController]:
    """A controller over a host pool in ``layout`` with the pool as its L3 (``interface_v1``: the zero-copy calls)."""
    dev, host = pools(layout)
    allocator = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, need_sort=False)
    ctrl = HiCacheController(
        allocator,
        host,
        PAGE,
        tp_group,
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
    as its radix cache keys them: the storage chain); the pages
    (in the pool object's order) and how many tokens the backup thread says it saved."""
    host: MHATokenToKVPoolHost = ctrl.mem_pool_host
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
    ctrl.prefetch(req, tokens, None, None)
    hit = ctrl.prefetch_hit_queue.get(timeout=WAIT_S)
    if hit.storage_hit_count == 0:
        return []
    host: MHATokenToKVPoolHost = ctrl.mem_pool_host
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


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_backup_then_prefetch_through_the_controller(tp_group: Any, extra: dict[str, Any], layout: str) -> None:
    with attached(tp_group, extra, layout) as ctrl:
        assert isinstance(ctrl.storage_backend, KvPoolStorage)
        assert ctrl.page_set_func.__name__ == "_page_set_zero_copy"
        tokens = list(range(1000, 1000 + 6 * PAGE))
        saved, done = back_up(ctrl, tokens)
        assert done == len(tokens)
        got = prefetch(ctrl, tokens, "req-1")
        assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(got, saved, strict=True))
        # a prompt that shares the first pages only: those come, the rest is SGLang's to compute
        got = prefetch(ctrl, tokens[: 3 * PAGE] + list(range(5000, 5000 + 3 * PAGE)), "req-2")
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, saved[:3], strict=True))


def test_every_prefetch_gives_the_right_bytes_or_a_miss_under_sglangs_failure_injector(
    monkeypatch: pytest.MonkeyPatch, tp_group: Any, extra: dict[str, Any]
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    with attached(tp_group, extra) as ctrl:
        assert isinstance(ctrl.storage_backend._backend, KvPoolStorage)  # wrapped by the injector
        loaded = 0
        for round_ in range(12):
            tokens = list(range(10_000 * (round_ + 1), 10_000 * (round_ + 1) + 4 * PAGE))
            saved, done = back_up(ctrl, tokens)
            got = prefetch(ctrl, tokens, f"req-{round_}")
            assert len(got) <= done // PAGE  # nothing the backup did not save
            assert all(torch.equal(a, b) for a, b in zip(got, saved, strict=False))
            loaded += len(got)
        assert loaded > 0  # with failures at 30 %, some prefetches still load pages
