"""Tenants' quotas on one node's store: a tenant over its DRAM share moves its own LRU chunks down, over its NVMe
share (or DRAM, with no NVMe) drops them; other tenants' chunks are not touched.  Real segments; no Ray, no etcd."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.clock import ManualClock
from kvpool.core.types import DropCause, Tier
from kvpool.errors import ConfigError
from kvpool.pool.chunks import ChangeKind, Origin
from kvpool.pool.config import PoolConfig
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment, NvmeSegment

BLOCK = 64 * 1024


def key(tenant: str, i: int) -> bytes:
    return (tenant.encode() + i.to_bytes(4, "big")).ljust(32, b"\0")


def data(i: int) -> memoryview:
    return memoryview(np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())


@pytest.fixture
def segments(tmp_path: Path) -> Iterator[tuple[DramSegment, NvmeSegment]]:
    dram = DramSegment.create(16 * BLOCK, "/dev/shm")
    nvme = NvmeSegment.create(16 * BLOCK, str(tmp_path))
    yield dram, nvme
    dram.close()
    nvme.close()


def put(store: ChunkStore, clock: ManualClock, tenant: str, ids: range) -> None:
    for i in ids:
        store.put(key(tenant, i), data(i), checksum=i, origin=Origin(tenant))
        clock.advance(1)


def test_a_tenant_over_its_quota_loses_its_own_oldest_chunks(segments: tuple[DramSegment, NvmeSegment]) -> None:
    clock = ManualClock()
    store = ChunkStore(*segments, clock=clock, quotas={"acme": (3 * BLOCK, 2 * BLOCK)})
    put(store, clock, "globex", range(3))
    put(store, clock, "acme", range(8))
    used = store.policy.used()
    assert used["acme"] == {Tier.DRAM: 3 * BLOCK, Tier.NVME: 2 * BLOCK}  # at its quota in both tiers
    assert used["globex"] == {Tier.DRAM: 3 * BLOCK}  # nobody else paid for it
    held = {i for i in range(8) if key("acme", i) in store}
    assert held == {3, 4, 5, 6, 7}  # the newest: 5, 6, 7 in DRAM, 3, 4 moved down
    assert {store.held(key("acme", i)).tier for i in (3, 4)} == {Tier.NVME}  # type: ignore[union-attr]
    dropped = [c for c in store.take_changes() if c.kind is ChangeKind.DROPPED]
    assert {c.chunk.key for c in dropped} == {key("acme", i) for i in range(3)}
    assert {c.cause for c in dropped} == {DropCause.EVICTED} and store.counters["quota_drops"] == 3
    assert all(c.tenant == "acme" for c in (store.held(key("acme", i)) for i in held) if c is not None)
    assert store.audit() == []


def test_without_nvme_a_tenant_over_its_dram_quota_drops_and_pinned_chunks_stay(
    segments: tuple[DramSegment, NvmeSegment],
) -> None:
    clock = ManualClock()
    store = ChunkStore(segments[0], clock=clock, quotas={"acme": (2 * BLOCK, 0)})
    put(store, clock, "acme", range(1))
    store.locate(key("acme", 0))  # a reader holds the oldest
    put(store, clock, "acme", range(1, 4))
    assert {i for i in range(4) if key("acme", i) in store} == {0, 3}  # 1 and 2 went instead of the pinned one
    store.release(key("acme", 0))
    put(store, clock, "acme", range(4, 5))
    assert {i for i in range(5) if key("acme", i) in store} == {3, 4}
    put(store, clock, "", range(100, 110))  # no tenant: no quota
    assert store.policy.used()[""] == {Tier.DRAM: 10 * BLOCK}


@pytest.mark.parametrize(
    "quotas",
    [{"acme": (1, 2, 3)}, {"acme": (-1, 0)}, {"": (1, 1)}, [("acme", (1, 1))], {"acme": (1.5, 0)}],
)
def test_malformed_quotas_are_refused(quotas: object) -> None:
    with pytest.raises(ConfigError, match="quotas"):
        PoolConfig(quotas=quotas)  # type: ignore[arg-type]
