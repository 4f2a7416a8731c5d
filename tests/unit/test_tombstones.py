"""Tombstones and departures: their etcd keys and values, and how many pool objects a chunk of an identity is."""

import pytest

from kvpool.core.keys import chunk_keys, layer_key
from kvpool.core.types import Departure, DropCause, Tier, Tombstone
from kvpool.errors import MalformedRecord
from kvpool.metadata.misses import object_keys, objects_per_chunk
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import decode_departure, decode_tombstone, encode_departure, encode_tombstone
from kvpool.prefill_decode.reference.layout import KVLayout

KEY = bytes(range(32))


def test_tombstone_and_departure_round_trip() -> None:
    t = Tombstone(KEY, "node-1", DropCause.EVICTED, Tier.NVME, 1.7e9, "lru")
    assert decode_tombstone(KEY, "node-1", encode_tombstone(t)) == t
    d = Departure("node-2", 41, 1.7e9)
    assert decode_departure("node-2", encode_departure(d)) == d
    for bad in (b"", b"\x80", encode_departure(d)):
        with pytest.raises(MalformedRecord):
            decode_tombstone(KEY, "node-1", bad)
    with pytest.raises(MalformedRecord):
        decode_departure("node-2", encode_tombstone(t))


def test_keys() -> None:
    ns = Namespace("c")
    assert ns.parse_tombstone(ns.tombstone(KEY, "node-1")) == (KEY, "node-1")
    assert ns.parse_departure(ns.departure("node-2")) == "node-2"
    assert not ns.tombstone(KEY, "n").startswith(ns.chunks) and not ns.departure("n").startswith(ns.nodes)
    with pytest.raises(MalformedRecord):
        ns.parse_tombstone(ns.replica(KEY, "node-1"))


@pytest.mark.parametrize(
    ("layout", "layers"),
    [(name, 8) for name in ("per-layer", "groups-of-2", "groups-of-4", "all-layers", "auto")]
    + [(name, 1) for name in ("per-layer", "all-layers", "auto")],
)
def test_object_keys_match_the_layouts(layout: str, layers: int) -> None:
    """What explain derives from an identity's layout string is what the workers store."""
    import torch

    kv = KVLayout(layers=layers, kv_heads=2, head_dim=32, dtype=torch.float16, chunk_size=4, layout=layout)
    ident = kv.identity("m")
    tokens = list(range(12))
    assert [object_keys(ident, k) for k in chunk_keys(ident, tokens)] == kv.keys(ident, tokens)
    assert objects_per_chunk(ident.layout) == kv.groups


def test_other_layouts_count_one_object() -> None:
    from kvpool.core.keys import CacheIdentity

    vllm = CacheIdentity(
        "m", "bfloat16", "vllm-0.11:cpu:TORCH_SDPA:FullAttentionSpec:kv_heads=2:head_size=64:block=16", 16
    )
    assert object_keys(vllm, KEY) == [layer_key(KEY, 0)]
    assert object_keys(CacheIdentity("m", "u8", "bytes", 16), KEY) == [KEY]
