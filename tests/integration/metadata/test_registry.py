import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvpool.clock import ManualClock
from kvpool.core.types import NodeRecord, SegmentInfo, Tier
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.lease import LeaseState
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import decode_node
from kvpool.metadata.registry import NodeRegistry

PROCS = str(Path(__file__).with_name("procs.py"))


def spawn(role: str, **args: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, PROCS, role, json.dumps(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert json.loads(line)["ready"], line
    return proc


def record(node_id: str = "n1") -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        host="127.0.0.2",
        pid=os.getpid(),
        address=b"ucx-address",
        segments=(SegmentInfo("dram0", Tier.DRAM, 1 << 30, 0), SegmentInfo("nvme0", Tier.NVME, 4 << 30, 0)),
    )


def nodes(etcd: EtcdClient, namespace: Namespace) -> list[NodeRecord]:
    """The node records in etcd, read straight from it."""
    return [decode_node(namespace.parse_node(kv.key), kv.value) for kv in etcd.get_prefix(namespace.nodes)]


def test_register_update_and_leave(etcd: EtcdClient, namespace: Namespace, metadata_config: MetadataConfig) -> None:
    registry = NodeRegistry(etcd, namespace, metadata_config.lease_ttl_s)
    reg = registry.register(record())
    try:
        [got] = nodes(etcd, namespace)
        assert got.node_id == "n1" and got.address == b"ucx-address" and got.capacity(Tier.NVME) == 4 << 30
        assert etcd.get(namespace.node("n1")).lease == reg.lease_id  # type: ignore[union-attr]
        reg.update(replace(record(), segments=(SegmentInfo("dram0", Tier.DRAM, 1 << 30, 123),)))
        assert [n.used(Tier.DRAM) for n in nodes(etcd, namespace)] == [123]
    finally:
        reg.close()
    assert nodes(etcd, namespace) == []  # revoked: gone at once, not after the TTL


def test_dead_process_vanishes_within_ttl(
    etcd: EtcdClient, namespace: Namespace, metadata_config: MetadataConfig, cache: MetadataCache
) -> None:
    """kill -9 a node process: its record and every placement on its lease go within TTL + 1 s."""
    ttl = metadata_config.lease_ttl_s
    proc = spawn(
        "node",
        endpoint=metadata_config.endpoints[0],
        cluster=metadata_config.cluster,
        ttl=ttl,
        node="victim",
        chunks=50,
    )
    try:
        cache.sync()
        assert [n.node_id for n in cache.nodes()] == ["victim"]
        assert cache.replica_count("victim") == 50
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # woken by the watch's delete events, not polled
        assert cache.wait_until(lambda c: not c.nodes() and not c.chunk_count(), timeout_s=ttl + 1.0)
        gone_after = time.monotonic() - killed
        assert nodes(etcd, namespace) == []
        assert etcd.get_prefix(namespace.chunks) == []
        print(f"node gone {gone_after:.2f} s after kill (TTL {ttl} s)")
    finally:
        proc.kill()


def test_lost_lease_is_replaced_and_republished(
    metadata_config: MetadataConfig, etcd: EtcdClient, namespace: Namespace
) -> None:
    """The keeper's decisions, driven by a manual clock: no sleeping for TTLs."""
    clock = ManualClock()
    republished: list[int] = []
    registry = NodeRegistry(etcd, namespace, metadata_config.lease_ttl_s, clock=clock)
    reg = registry.register(record(), on_new_lease=republished.append, keep_alive=False)
    keeper = reg.keeper
    assert keeper.tick() is LeaseState.ALIVE

    # etcd forgets the lease (as after an outage longer than the TTL): the next tick notices,
    # grants a new lease, re-publishes the record on it and tells the owner.
    old = reg.lease_id
    etcd.revoke_lease(old)
    assert nodes(etcd, namespace) == []
    assert keeper.tick() is LeaseState.ALIVE
    assert reg.lease_id != old and republished == [reg.lease_id] and keeper.renewals == 1
    assert [n.node_id for n in nodes(etcd, namespace)] == ["n1"]
    reg.close()


def test_unreachable_etcd_makes_the_lease_uncertain_then_lost(metadata_config: MetadataConfig) -> None:
    from kvpool.servers.etcd import EmbeddedEtcd

    clock = ManualClock()
    with EmbeddedEtcd() as server:
        cfg = metadata_config.with_endpoints(server.endpoint)
        etcd = EtcdClient(cfg)
        republished: list[int] = []
        reg = NodeRegistry(etcd, Namespace(cfg.cluster), cfg.lease_ttl_s, clock=clock).register(
            record(), on_new_lease=republished.append, keep_alive=False
        )
        server.kill()
        assert reg.keeper.tick() is LeaseState.UNCERTAIN  # within the TTL: maybe still alive
        clock.advance(cfg.lease_ttl_s + 0.5)
        assert reg.keeper.tick() is LeaseState.LOST  # the TTL has passed without a refresh
        assert reg.keeper.tick() is LeaseState.LOST  # still no etcd: cannot replace it yet
        server.start()
        etcd.revision()  # wait until the client has reconnected (its retries span seconds, a tick's do not)
        old_lease = reg.lease_id
        assert reg.keeper.tick() is LeaseState.ALIVE
        assert len(republished) == 1 and republished[0] == reg.lease_id != old_lease
        assert etcd.refresh_lease(old_lease) == 0  # the old lease was revoked, not left to expire later
        reg.close()
        etcd.close()


@pytest.mark.parametrize("ttl", [0, -1, 1.5])
def test_bad_ttl_is_a_config_error(ttl: object) -> None:
    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="lease_ttl_s"):
        MetadataConfig(lease_ttl_s=ttl)  # type: ignore[arg-type]
