"""``KvPoolStorage`` under SGLang's real ``HiCacheController`` (level 3): its backup thread saves pages through
``batch_set_v1``, its prefetch threads find them (``batch_exists``) and load them into new host slots
(``batch_get_v1``), as a server's radix cache drives them; with SGLang's own failure injector, every prefetch gives
the right bytes or a miss."""

from typing import Any

import pytest
import torch
from hicache import PAGE, attached, back_up, prefetch
from sglang_needed import sglang_module

from kvpool.prefill_decode.sglang.cpu_import import tp_group

sglang_module("sglang.srt.mem_cache.hicache_storage")  # a skip where SGLang is not installed (see sglang_needed)

from kvpool.prefill_decode.sglang.storage import KvPoolStorage  # noqa: E402


@pytest.fixture(scope="module")
def group() -> Any:
    """SGLang's TP group of one rank, as its scheduler sets it up."""
    return tp_group()


@pytest.mark.parametrize(("layout", "mla"), [("page_first", False), ("layer_first", False), ("page_first", True)])
def test_backup_then_prefetch_through_the_controller(group: Any, extra: dict[str, Any], layout: str, mla: bool) -> None:
    """MHA and MLA host pools (with MLA the controller tells the backend so: is_mla_model, one writer rank)."""
    with attached(group, extra, layout, mla=mla) as ctrl:
        assert isinstance(ctrl.storage_backend, KvPoolStorage)
        assert ctrl.storage_config.is_mla_model is mla and ctrl.storage_backend.pages.mla is mla
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
    monkeypatch: pytest.MonkeyPatch, group: Any, extra: dict[str, Any]
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    with attached(group, extra) as ctrl:
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
