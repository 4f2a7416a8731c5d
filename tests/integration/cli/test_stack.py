"""``kvpool.stack`` called as a library, in this process: a pool on the session's Ray cluster, checked, and the
prefill/decode demo on it (``kvpool up`` runs the same calls on a stack of its own; test_cli.py runs that)."""

import uuid

import ray

from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.prefill_decode.reference.demo import run_demo
from kvpool.stack import StackConfig, check_pool, demo_service, running_pool


def test_a_running_pool_its_check_and_the_demo(
    ray_cluster: list[str], metadata_config: MetadataConfig, cache: MetadataCache
) -> None:
    pool = PoolConfig(
        metadata=metadata_config, dram_bytes=32 * MiB, nvme_bytes=32 * MiB, namespace=f"stack-{uuid.uuid4().hex[:8]}"
    )
    config = StackConfig(pool=pool, ray_address=ray.get_runtime_context().gcs_address)
    with running_pool(config) as running:
        assert running == pool  # an etcd was given: nothing to fill in
        check = check_pool(running)
        assert check.verified and check.found == check.chunks == 16
        with demo_service(running, "tiny-llama") as service:
            run = run_demo(service)
        assert run.cold.prefill.summary.reused_tokens == 0 and run.warm.prefill.summary.reused_tokens > 0
        assert run.warm.tokens == run.cold.tokens
        with PoolClient(running) as client:
            assert len(client.cache.nodes()) == len(ray_cluster)
    assert ray.is_initialized()  # attached before: left attached
    assert cache.wait_until(lambda c: not c.nodes(), timeout_s=10)  # the pool stopped on exit
