"""The fleet simulator (bench/fleet_sim.py) against a real pool: the first 600 requests of each Mooncake trace, scaled
down to 16-token chunks of one page and 8 MiB of DRAM a node (a third to two thirds of the slice's reuse fits), replayed with real puts and gets on the session's three
Ray nodes, give the simulator's hit rates within 2 points."""

from collections.abc import Iterator

import pytest
from pools import PoolShelf, names

from kvpool.bench.fleet_check import Check, real, simulated
from kvpool.bench.workloads.mooncake import trace_path
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig

CHECK = Check()
pytestmark = pytest.mark.skipif(
    not trace_path("conversation").exists(), reason="the Mooncake traces are not beside the repository"
)


def _check_pool(etcd: str) -> PoolConfig:
    """The check's configuration: three nodes of 8 MiB DRAM, no NVMe."""
    metadata, namespace = names(etcd, lease_ttl_s=2)
    return PoolConfig(
        metadata=metadata,
        dram_bytes=CHECK.dram_bytes,
        nvme_bytes=-1,
        alignment=CHECK.alignment,
        namespace=namespace,
    )


@pytest.fixture
def dram_pool(pool_shelf: PoolShelf) -> Iterator[PoolConfig]:
    """The check's pool, empty (``tests/pools.py``)."""
    with pool_shelf.lend(_check_pool) as config:
        yield config


@pytest.mark.parametrize("trace", ["conversation", "synthetic"])
def test_the_simulator_gives_the_real_pools_hit_rate(trace: str, dram_pool: PoolConfig, ray_cluster: list[str]) -> None:
    requests = CHECK.trace(trace)
    expected = simulated(CHECK, requests)
    with PoolClient(dram_pool) as client:
        measured, wrong = real(CHECK, client, ray_cluster, requests)
    print(f"\n{trace}: real {measured:.4f}, simulated {expected:.4f}")
    assert wrong == 0
    assert 0 < expected < 1
    assert abs(measured - expected) <= 0.02, (trace, measured, expected)
