"""Every public call of ``PoolClient`` answers bad arguments with a ``KvPoolError`` (never a bare ``ValueError``,
``TypeError``, ``KeyError`` or ``AttributeError`` from our code), and the pool stays consistent after them."""

import inspect
import itertools
from typing import Any

import numpy as np
import pytest
import ray
import torch

from kvpool.core.keys import CacheIdentity
from kvpool.core.types import Tier
from kvpool.errors import KvPoolError
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig
from kvpool.pool.protocol import actor_name

KEY = bytes(range(32))
MISSING = bytes(32)  # a well-formed key the pool does not hold
BAD = [
    None,
    0,
    -1,
    1.5,
    float("nan"),
    True,
    "text",
    b"short",
    b"",
    object(),
    {},
    {"k": 1},
    [None],
    [b"short"],
    [1, 2],
    (KEY, KEY),
    [MISSING],
    "dram",
    Tier.DRAM,
    np.zeros(3, dtype=np.float64),
    torch.zeros(2, 3).t(),  # a non-contiguous tensor
]

#: a good call of each public method, as (args, kwargs); the walk swaps one argument at a time for a bad one
GOOD: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "put": ((KEY, b"x" * 64), {"replicas": 1}),
    "put_batch": (([(KEY, b"x" * 64)],), {"replicas": 1, "nodes": ()}),
    "get": ((KEY,), {}),
    "get_batch": (([KEY],), {}),
    "get_into": ((KEY, bytearray(64)), {}),
    "get_into_batch": (([KEY], [bytearray(64)]), {"on_done": None}),
    "get_into_device": (([KEY], [torch.zeros(64, dtype=torch.uint8)]), {}),
    "register_buffer": ((np.zeros(64, dtype=np.uint8),), {}),
    "unregister_buffer": ((np.zeros(64, dtype=np.uint8),), {}),
    "exists": ((KEY,), {}),
    "exists_batch": (([KEY],), {}),
    "lookup_prefix": (([KEY],), {}),
    "count_lookup": ((1, 1), {}),
    "register_identity": ((CacheIdentity(model="m", kv_dtype="u8", layout="b"),), {}),
    "record_engine": (({"tokens": 1},), {}),
    "remove": ((MISSING,), {}),
    "remove_batch": (([MISSING],), {}),
    "move": (([KEY], Tier.DRAM), {}),
    "remote_gc": ((), {"grace_s": 10.0}),
    "stats": ((), {}),
    "prefetch": (([KEY],), {"node": "", "tenant": ""}),
    "connect_peers": ((), {}),
}
NOT_WALKED = {"close"}  # ends the client: called last, by the fixture


def test_every_public_method_is_walked() -> None:
    public = {n for n, _ in inspect.getmembers(PoolClient, inspect.isfunction) if not n.startswith("_")}
    assert public - NOT_WALKED == set(GOOD), "add the new public method to GOOD"


def _cases() -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    out = []
    for name, (args, kwargs) in GOOD.items():
        for i, bad in itertools.product(range(len(args)), BAD):
            out.append((name, (*args[:i], bad, *args[i + 1 :]), kwargs))
        for key, bad in itertools.product(kwargs, BAD):
            out.append((name, args, {**kwargs, key: bad}))
    return out


def test_bad_arguments_get_a_kvpool_error_and_leave_the_pool_consistent(
    client: PoolClient, pool: PoolConfig, ray_cluster: list[str]
) -> None:
    client.put(KEY, b"x" * 64)
    escaped = []
    for name, args, kwargs in _cases():
        try:
            getattr(client, name)(*args, **kwargs)
        except KvPoolError:
            pass
        except Exception as exc:  # what this test is for: anything else escaping a public call
            escaped.append(f"{name}{tuple(map(_short, args))} {kwargs}: {type(exc).__name__}: {exc}")
    assert not escaped, "\n".join(escaped[:20])
    fresh = bytes(range(1, 33))  # the pool still takes and serves chunks
    client.put(fresh, b"y" * 64)
    assert client.get(fresh) == b"y" * 64
    for node_id in ray_cluster:
        node = ray.get_actor(actor_name(node_id), namespace=pool.namespace)
        assert ray.get(node.audit.remote()) == []


def _short(a: Any) -> str:
    return f"{a!r:.30}"


@pytest.mark.parametrize("bad", [None, "x", 0])
def test_a_client_on_a_bad_config_is_a_config_error(bad: Any) -> None:
    with pytest.raises(KvPoolError):
        PoolClient(bad)
