"""The engine-neutral connector core (prefill_decode/connector_core): one prefix lookup (hit, miss cause, access log),
one host staging buffer, one tenant scope, one place that counts.  Pure logic over fakes of the watch cache and the
pool client: no pool, no engine."""

from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.core.types import DropCause, Placement, Tier, Tombstone, nearest
from kvpool.errors import TransferError
from kvpool.metadata.lookup import Hit, PrefixLookup
from kvpool.metadata.misses import MissCause
from kvpool.pool.tenants import new_secret
from kvpool.prefill_decode.connector_core.counts import EngineCounts
from kvpool.prefill_decode.connector_core.staging import EngineMemory, HostStaging
from kvpool.prefill_decode.connector_core.tenancy import TenantScope


def placement(key: bytes, node: str = "n1", tier: Tier = Tier.DRAM) -> Placement:
    return Placement(key, node, tier, offset=0, stored=10, size=10, checksum=0)


class FakeCache:
    """What the core reads of a MetadataCache: replicas (on node n1, in ``tier``) and tombstones by key."""

    def __init__(
        self, held: set[bytes], stones: dict[bytes, list[Tombstone]] | None = None, tier: Tier = Tier.DRAM
    ) -> None:
        self.held, self.stones, self.tier = held, stones or {}, tier

    def lookup_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n

    def replicas(self, key: bytes) -> list[Placement]:
        return [placement(key, tier=self.tier)] if key in self.held else []

    def size_of(self, key: bytes) -> int:
        return 10 if key in self.held else 0

    def tombstones(self, key: bytes) -> list[Tombstone]:
        return self.stones.get(key, [])

    def left_with_node(self, key: bytes) -> None:
        return None


class FakeLog:
    def __init__(self) -> None:
        self.lookups: list[list[bytes]] = []

    def record(self, keys: list[bytes], size_of: Any) -> None:
        self.lookups.append(list(keys))


def objects(chunks: int, per_chunk: int) -> list[list[bytes]]:
    return [[bytes([c, o]) * 16 for o in range(per_chunk)] for c in range(chunks)]


def test_a_chunk_counts_when_every_one_of_its_objects_is_held() -> None:
    keys = objects(4, 3)
    missing = keys[2][1]  # one object of chunk 2: chunks 2 and 3 do not count
    log = FakeLog()
    hit = PrefixLookup(log)(FakeCache({k for chunk in keys for k in chunk} - {missing}), keys)  # type: ignore[arg-type]
    assert hit == Hit(asked=4, held=2, cause=MissCause.NEVER_STORED)
    assert log.lookups == [[k for chunk in keys for k in chunk]]  # every object the request needs, once


def test_the_miss_cause_is_the_first_missing_objects() -> None:
    keys = objects(2, 2)
    stone = Tombstone(keys[0][0], "n1", DropCause.EVICTED, Tier.DRAM, at=0.0, policy="lru")
    hit = PrefixLookup(None)(FakeCache(set(), {keys[0][0]: [stone]}), keys)  # type: ignore[arg-type]
    assert hit == Hit(2, 0, MissCause.EVICTED)
    every = PrefixLookup(None)(FakeCache({k for c in keys for k in c}), keys)  # type: ignore[arg-type]
    assert every == Hit(2, 2, None) and PrefixLookup(None)(FakeCache(set()), []) == Hit(0, 0, None)  # type: ignore[arg-type]


def test_the_nearest_replica_is_the_documented_order() -> None:
    key = b"k" * 32
    far, near = placement(key, "peer", Tier.DRAM), placement(key, "here", Tier.NVME)
    assert nearest([far, near], "here") == near and nearest([], "here") is None


class FakeClient:
    def __init__(self) -> None:
        self.registered: list[int] = []

    def register_buffer(self, buffer: Any) -> None:
        self.registered.append(buffer.data_ptr())

    def unregister_buffer(self, buffer: Any) -> None:
        self.registered.remove(buffer.data_ptr())


def test_staging_grows_by_doubling_and_registers_once_per_buffer() -> None:
    client, staging = FakeClient(), HostStaging()
    first = staging.get(client, 100)
    assert first.numel() == 100 and client.registered == []  # same-node reads: no registration
    assert staging.get(client, 80, register=True) is first and client.registered == [first.data_ptr()]
    assert staging.get(client, 100, register=True) is first and len(client.registered) == 1  # once
    grown = staging.get(client, 150, register=True)
    assert grown.numel() == 200 and client.registered == [grown.data_ptr()]  # the old one unregistered
    assert staging.get(client, 500).numel() == 500 and client.registered == []  # grown past double: what is asked
    staging.close(client)
    assert client.registered == []


def test_engine_memory_is_registered_once_and_a_failed_registration_is_not_tried_again() -> None:
    client, memory, kv = FakeClient(), EngineMemory(), torch.zeros(64, dtype=torch.uint8)
    memory.register(client, lambda: [kv])
    memory.register(client, lambda: [kv])
    assert client.registered == [kv.data_ptr()] and memory.registered
    memory.close(client)
    assert client.registered == [] and not memory.registered

    def refused() -> list[torch.Tensor]:
        raise TransferError("the transport cannot register this memory")

    failed = EngineMemory()
    failed.register(client, refused)
    failed.register(client, lambda: [kv])  # not tried again: peer reads go through the client's staging
    assert client.registered == [] and not failed.registered


def test_a_tenant_scope_names_the_tenant_and_its_chain(tmp_path: Path) -> None:
    none = TenantScope.load("")
    assert none.tenant_of(None) == "" and none.tenant_of("anything") == "" and none.scope("") is None
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.acme]\nsecret = "{new_secret()}"\napi_keys = ["sk-acme"]\n')
    scope = TenantScope.load(str(path))
    assert scope.tenant_of("sk-acme") == "acme"
    assert scope.tenant_of("sk-nobody") is None and scope.tenant_of(None) is None  # refused: no pool use
    acme = scope.scope("acme")
    assert acme is not None and acme.tenant == "acme" and scope.scope("") is None


class FakeSink:
    def __init__(self) -> None:
        self.reports: list[dict[str, float]] = []

    def record_engine(self, counts: dict[str, float]) -> None:
        self.reports.append(counts)


def test_counts_are_reported_once_and_kept_in_totals() -> None:
    counts, sink = EngineCounts(), FakeSink()
    counts.lookup(Hit(4, 4), prompt_tokens=64, chunk_size=16)  # every chunk held: the last token is computed
    counts.lookup(Hit(4, 1, MissCause.EVICTED), prompt_tokens=70, chunk_size=16)
    counts.add(loaded_bytes=10)
    counts.report(sink)
    counts.report(sink)  # nothing new: nothing sent
    counts.miss(MissCause.READ_FAILED, 2)
    assert counts.take() == {"miss_read_failed": 2} and counts.take() == {}
    assert sink.reports == [{"lookup_tokens": 134, "hit_tokens": 63 + 16, "miss_evicted": 1, "loaded_bytes": 10}]
    assert counts.totals["lookup_tokens"] == 134 and counts.totals["miss_read_failed"] == 2


def test_a_clients_transfer_faults_count_once_for_the_engine_and_never_go_back_to_the_pool() -> None:
    counts = EngineCounts(readers=("pool", "engine"))
    counts.transfer_faults({"read_failed": 2})
    counts.transfer_faults({"read_failed": 2, "late": 1})  # only the late one is new
    assert counts.take("engine") == {"fault_read_failed": 2, "fault_late": 1}
    assert counts.take("pool") == {}  # the client reported them to its node itself
    counts.transfer_faults({"read_failed": 1})  # a client made anew counts from 0: its 1 is new
    assert counts.take("engine") == {"fault_read_failed": 1}
    assert counts.totals == {"fault_read_failed": 3, "fault_late": 1}


@pytest.mark.parametrize(("held", "prompt", "hit"), [(0, 10, 0), (1, 1, 0), (2, 40, 32)])
def test_hit_tokens_never_include_the_last_prompt_token(held: int, prompt: int, hit: int) -> None:
    counts = EngineCounts()
    counts.lookup(Hit(2, held), prompt, 16)
    assert counts.totals["hit_tokens"] == hit
