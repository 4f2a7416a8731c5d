"""The prefetches requests wait for (prefill_decode/connector_core/prefetch.py) and the hint that asks for one
(prefill_decode/vllm/hint.py): over a fake connection and a moved clock, no pool, no engine."""

import threading
from typing import Any

import pytest
from test_connector_core import FakeCache

from kvpool.core.types import Tier
from kvpool.errors import ConfigError, NodeUnreachable
from kvpool.pool.client.prefetch import Prefetched
from kvpool.prefill_decode.connector_core.counts import EngineCounts
from kvpool.prefill_decode.connector_core.prefetch import RequestPrefetches
from kvpool.prefill_decode.vllm.hint import NO_HINT, PoolHint, pool_hint

KEYS = [bytes([i]) * 32 for i in range(4)]


class FakeConnection:
    """A PoolConnection whose client (on node n1) prefetches once ``release`` is set, or raises ``error``."""

    def __init__(self, error: Exception | None = None, reachable: bool = True) -> None:
        self.error_to_raise, self.reachable = error, reachable
        self.release = threading.Event()
        self.asked: list[tuple[list[bytes], str, str]] = []
        self._client: Any = None
        self.error = "" if reachable else "etcd down"
        self.closed = False

    def client(self) -> Any:
        if self.reachable:
            self._client = self
        return self._client

    @property
    def connected(self) -> Any:
        return self._client

    node_id = "n1"

    def prefetch(self, keys: list[bytes], node: str, tenant: str) -> Prefetched:
        self.asked.append((keys, node, tenant))
        assert self.release.wait(10)
        if self.error_to_raise is not None:
            raise self.error_to_raise
        return Prefetched(already=1, promoted=len(keys) - 2, copied=1, not_held=0, nbytes=100)

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prefetches(connection: FakeConnection) -> tuple[RequestPrefetches, EngineCounts, Clock]:
    counts, clock = EngineCounts(), Clock()
    return RequestPrefetches(connection, counts, wait_s=2.0, clock=clock), counts, clock


def test_a_request_waits_for_its_prefetch_until_it_ends() -> None:
    connection = FakeConnection()
    p, counts, _ = prefetches(connection)
    assert p.needed(KEYS, FakeCache(set(KEYS))) and not p.needed(
        [], FakeCache(set())
    )  # no client yet: its node unknown
    assert not p.started("r1") and not p.waiting("r1")
    p.start("r1", KEYS, "acme")
    assert p.started("r1") and p.waiting("r1")
    connection.release.set()
    p.close()  # waits for the queued prefetch, then closes the client on its thread
    assert not p.waiting("r1") and connection.closed
    assert connection.asked == [(KEYS, "", "acme")]  # "": the client's own node
    assert counts.totals == {"prefetch_started": 1, "prefetch_promoted": 2, "prefetch_copied": 1}
    p.forget("r1")
    assert not p.started("r1")


def test_once_the_client_is_made_only_keys_away_from_its_nodes_dram_need_one() -> None:
    connection = FakeConnection()
    connection.client()
    p, _, _ = prefetches(connection)
    assert not p.needed(KEYS, FakeCache(set(KEYS)))  # all in n1's DRAM
    assert p.needed(KEYS, FakeCache(set(KEYS), tier=Tier.NVME))
    p.close()


def test_past_its_deadline_a_request_stops_waiting_and_the_prefetch_is_counted_late_once() -> None:
    connection = FakeConnection()
    p, counts, clock = prefetches(connection)
    p.start("r1", KEYS)
    clock.now += 1.9
    assert p.waiting("r1")
    clock.now += 0.2
    assert not p.waiting("r1") and not p.waiting("r1")
    connection.release.set()
    p.close()
    assert counts.totals["prefetch_late"] == 1 and counts.totals["prefetch_promoted"] == 2


@pytest.mark.parametrize("connection", [FakeConnection(NodeUnreachable("node left")), FakeConnection(reachable=False)])
def test_a_failed_prefetch_is_counted_and_never_raised(connection: FakeConnection) -> None:
    p, counts, _ = prefetches(connection)
    connection.release.set()
    p.start("r1", KEYS)
    p.close()
    assert not p.waiting("r1")
    assert counts.totals == {"prefetch_started": 1, "prefetch_failed": 1}


@pytest.mark.parametrize(
    ("params", "hint"),
    [
        (None, NO_HINT),
        ({}, NO_HINT),
        ({"do_remote_prefill": True}, NO_HINT),  # another connector's keys are left alone
        ({"kvpool": {}}, NO_HINT),
        ({"kvpool": {"prefetch": True}}, PoolHint(prefetch=True)),
        ({"kvpool": {"prefetch": False}, "other": 1}, NO_HINT),
    ],
)
def test_a_hint_is_kvpools_key_of_kv_transfer_params(params: Any, hint: PoolHint) -> None:
    assert pool_hint(params) == hint


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"kvpool": {"prefetch": "yes"}}, r"kv_transfer_params\['kvpool'\]: `prefetch` expected `bool`, got str"),
        ({"kvpool": {"prefech": True}}, "unknown field `prefech`; its fields are prefetch"),
        ({"kvpool": True}, "expected `object`, got `bool`"),
        ({"kvpool": None}, "expected `object`, got `null`"),
    ],
)
def test_a_malformed_hint_is_a_config_error_saying_what_to_write(params: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        pool_hint(params)
