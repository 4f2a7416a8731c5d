"""Bad input, generated: every malformed value kvpool parses gets a typed error with a message.

Property tests over the inputs that need no running Ray, etcd or NIXL: chunk keys, token lists, sizes
through the allocator and a node's chunk store, the records stored in etcd and the etcd keys they sit
under, configs, and transfer descriptors.  Each input either parses into what it says or raises the
:class:`~kvpool.errors.KvPoolError` subclass of its layer with a non-empty message; any other exception
(``KeyError``, ``TypeError``, a msgpack error, ...) fails the test with the input that caused it.  After
random sequences of good and bad calls the allocator and the store keep their invariants: no overlap, no
leak, a refused call changes nothing, and the change log a node publishes to etcd matches what it holds.

Reproducible: every test is derandomized and keeps no example database; each states its ``max_examples``.
"""

import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any, TypeVar
from unittest import mock

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvpool.core.keys import CacheIdentity, check_key, chunk_keys, layer_key, parse_key, token_array
from kvpool.core.types import NodeRecord, Placement, SegmentInfo, Tier
from kvpool.errors import ChunkNotFound, ConfigError, KvPoolError, MalformedRecord, PoolFull, SetupError, TransferError
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import SCHEMA_VERSION, decode_node, decode_placement, encode_node, encode_placement
from kvpool.pool.chunks import ChangeKind
from kvpool.pool.config import PoolConfig, Watermarks
from kvpool.pool.node.allocator import OffsetAllocator
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment, NvmeSegment
from kvpool.pool.tiers.s3_config import RemoteConfig
from kvpool.prefill_decode.reference.workers import WorkerConfig
from kvpool.transport import nixl
from kvpool.transport.base import Op

E = TypeVar("E", bound=KvPoolError)


def cases(n: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Settings for one property: ``n`` derandomized examples, no database, no deadline."""
    return settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def typed(
    expected: type[KvPoolError] | tuple[type[KvPoolError], ...], fn: Callable[..., Any], *args: Any, **kw: Any
) -> Any:
    """``fn(*args, **kw)``'s result, or the ``expected`` error it raised (checked for a message).

    Any other exception propagates, so hypothesis reports it with the input that caused it.
    """
    try:
        return fn(*args, **kw)
    except KvPoolError as exc:
        assert isinstance(exc, expected), f"{type(exc).__name__} where {expected} was due: {exc}"
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return exc


def refused(expected: type[E], fn: Callable[..., Any], *args: Any, match: str = "", **kw: Any) -> E:
    """The ``expected`` error ``fn`` must raise; its message must mention ``match``."""
    out = typed(expected, fn, *args, **kw)
    assert isinstance(out, expected), f"accepted: {fn.__qualname__}{args!r} returned {out!r}"
    assert match in str(out), f"{str(out)!r} does not mention {match!r}"
    return out


class Opaque:
    """An object no parser knows."""

    def __repr__(self) -> str:
        return "Opaque()"


#: values of the wrong type for almost anything
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.complex_numbers(max_magnitude=1e6),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.integers(), st.text(max_size=3)),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.frozensets(st.integers(), max_size=3),
    st.builds(Opaque),
)
#: any value msgpack can encode (what a corrupt or foreign writer could have stored), nested one level
packable_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=10),
    st.binary(max_size=10),
)
packable = st.one_of(
    packable_leaf,
    st.lists(packable_leaf, max_size=2),
    st.dictionaries(st.text(max_size=4), packable_leaf, max_size=2),
)
ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
#: names that may become etcd path segments (node ids, cluster names)
names = st.tuples(st.sampled_from(ALNUM), st.text(ALNUM + "_.-", max_size=20)).map("".join)
keys32 = st.binary(min_size=32, max_size=32)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# -- chunk keys ------------------------------------------------------------------------------------------

hex64 = keys32.map(bytes.hex)
key_texts = st.one_of(
    hex64,
    hex64.map(str.upper),
    hex64.map(lambda h: f"  {h}\n"),
    st.text(alphabet="0123456789abcdefABCDEF", max_size=80),  # wrong length
    st.tuples(hex64, st.integers(0, 63), st.characters()).map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + 1 :]),
    st.tuples(hex64, st.integers(1, 63)).map(lambda t: t[0][: t[1]] + " " + t[0][t[1] :]),  # a space inside
    st.text(max_size=80),
    junk,
)


@cases(1600)
@given(key_texts)
def test_chunk_key_text_parses_or_is_refused(text: Any) -> None:
    out = typed(ConfigError, parse_key, text)
    if isinstance(text, str) and re.fullmatch(r"[0-9a-fA-F]{64}", text.strip(), re.ASCII):
        assert out == bytes.fromhex(text.strip())
    else:
        assert isinstance(out, ConfigError), f"{text!r} parsed as a key"
        assert "64 hex digits" in str(out)


key_values = st.one_of(
    keys32,
    st.binary(max_size=70).filter(lambda b: len(b) != 32),
    keys32.map(bytearray),
    keys32.map(lambda b: memoryview(b)),
    hex64,
    junk,
)


@cases(1200)
@given(key_values, st.one_of(st.integers(-5, 2**33), junk))
def test_chunk_key_bytes_are_checked_wherever_a_key_is_taken(key: Any, layer: Any) -> None:
    ns = Namespace("bad-input")
    good = isinstance(key, bytes) and len(key) == 32
    for fn in (check_key, ns.chunk):
        out = typed(ConfigError, fn, key)
        assert not isinstance(out, ConfigError) if good else isinstance(out, ConfigError), (fn, key, out)
    lk = typed(ConfigError, layer_key, key, layer)
    good_layer = type(layer) is int and 0 <= layer < 2**32
    assert isinstance(lk, bytes) == (good and good_layer), (key, layer, lk)


# -- token lists ---------------------------------------------------------------------------------------

IDENTITY = CacheIdentity(model="bad-input", kv_dtype="uint8", layout="bytes", chunk_size=4)
np_ints = st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
token_items = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(-(2**70), 2**70),
    st.tuples(np_ints, st.integers(0, 127)).map(lambda t: t[0](t[1])),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.floats(),
    st.booleans(),
    st.just(np.bool_(True)),
    st.none(),
    st.text(max_size=3),
)


def token_containers(items: list[Any]) -> st.SearchStrategy[Any]:
    return st.sampled_from([items, tuple(items), iter(items), range(len(items))])


token_inputs = st.one_of(
    st.lists(token_items, max_size=16).flatmap(token_containers),
    st.lists(st.integers(0, 2**32 - 1), max_size=16),
    junk,
)


def valid_id(t: Any) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= int(t) < 2**32


@cases(1000)
@given(token_inputs)
def test_token_lists_are_validated_before_hashing(tokens: Any) -> None:
    items = list(tokens) if isinstance(tokens, (list, tuple, range)) else None
    if isinstance(tokens, Iterator):  # look at its values, then hand over a fresh iterator over them
        items = list(tokens)
        tokens = iter(items)
    ok = items is not None and all(valid_id(t) for t in items)
    arr = typed(ConfigError, token_array, tokens)
    if not ok:
        assert isinstance(arr, ConfigError), f"{tokens!r} accepted as token ids"
        assert "tokens" in str(arr)
        again = iter(items) if isinstance(tokens, Iterator) and items is not None else tokens
        assert isinstance(typed(ConfigError, chunk_keys, IDENTITY, again), ConfigError)
        return
    assert items is not None
    assert arr.dtype == np.dtype("<u4") and arr.tolist() == [int(t) for t in items]
    keys = chunk_keys(IDENTITY, iter(items) if isinstance(tokens, Iterator) else tokens)
    assert keys == chunk_keys(IDENTITY, [int(t) for t in items]) and len(keys) == len(items) // 4


@cases(300)
@given(
    hnp.arrays(
        dtype=st.one_of(
            hnp.integer_dtypes(endianness="?"),
            hnp.unsigned_integer_dtypes(endianness="?"),
            hnp.floating_dtypes(),
            hnp.boolean_dtypes(),
            hnp.complex_number_dtypes(),
            hnp.byte_string_dtypes(max_len=4),
            hnp.unicode_string_dtypes(max_len=4),
            hnp.datetime64_dtypes(),
        ),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    )
)
def test_numpy_token_arrays_of_the_wrong_dtype_or_shape_are_refused(arr: np.ndarray) -> None:
    ok = arr.dtype.kind in "iu" and arr.ndim == 1 and all(0 <= int(v) < 2**32 for v in arr.tolist())
    out = typed(ConfigError, token_array, arr)
    if ok:
        assert out.tolist() == [int(v) for v in arr.tolist()]
    else:
        assert isinstance(out, ConfigError), f"{arr!r} accepted as token ids"
        assert isinstance(typed(ConfigError, chunk_keys, IDENTITY, arr), ConfigError)


TORCH_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.float16,
    torch.float32,
    torch.bool,
]


@cases(200)
@given(st.sampled_from(TORCH_DTYPES), st.lists(st.integers(-128, 127), max_size=12), st.booleans())
def test_torch_token_tensors_of_the_wrong_dtype_or_shape_are_refused(
    dtype: Any, values: list[int], two_d: bool
) -> None:
    t = torch.tensor(values, dtype=torch.int64).to(dtype)
    if two_d:
        t = t.reshape(1, -1)
    ok = dtype not in (torch.float16, torch.float32, torch.bool) and not two_d and all(v >= 0 for v in t.tolist())
    out = typed(ConfigError, token_array, t)
    assert isinstance(out, np.ndarray) == ok, (t, out)


# -- sizes through the allocator -----------------------------------------------------------------------

sizes = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-8, 3 * 4096),
    st.sampled_from([0, -1, 1, 4095, 4096, 4097, 2**31, 2**32, 2**63 - 1, 2**63, 2**64]),
    st.integers(0, 2**20).map(np.int64),
    junk,
)


def good_size(size: Any) -> bool:
    return type(size) is int and size > 0


def snapshot(alloc: OffsetAllocator) -> tuple[Any, ...]:
    return alloc.stats(), list(alloc._free_starts), dict(alloc._free_size), dict(alloc._live)


@cases(800)
@given(sizes, st.lists(st.integers(1, 5 * 4096), max_size=6))
def test_allocator_refuses_bad_sizes_and_changes_nothing(size: Any, before: list[int]) -> None:
    alloc = OffsetAllocator(64 * 4096, alignment=4096)
    for s in before:
        alloc.allocate(s)
    state = snapshot(alloc)
    fits = typed(ConfigError, alloc.can_allocate, size)
    out = typed(PoolFull if good_size(size) else ConfigError, alloc.allocate, size)
    if good_size(size):
        assert isinstance(fits, bool) and isinstance(out, int) == fits
    else:
        assert isinstance(fits, ConfigError) and isinstance(out, ConfigError) and "size" in str(out)
    if not isinstance(out, int):
        assert snapshot(alloc) == state, "a refused allocation changed the allocator"
    alloc.check_invariants()


@cases(300)
@given(st.one_of(sizes, st.just(1 << 20)), st.one_of(st.sampled_from([1, 512, 4096, 3, 0, -4096]), junk))
def test_allocator_constructor_refuses_bad_capacity_and_alignment(capacity: Any, alignment: Any) -> None:
    out = typed(ConfigError, OffsetAllocator, capacity, alignment)
    ok = (
        good_size(capacity)
        and type(alignment) is int
        and alignment >= 1
        and alignment & (alignment - 1) == 0
        and capacity >= alignment
    )
    assert isinstance(out, OffsetAllocator) == ok, (capacity, alignment, out)
    if ok:
        assert out.capacity == capacity - capacity % alignment and out.free_bytes == out.capacity


alloc_calls = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 40_000)),
        st.tuples(st.just("alloc"), sizes),
        st.tuples(st.just("free"), st.integers(0, 1000)),  # the i-th live allocation (mod their count)
        st.tuples(st.just("free-bad"), st.one_of(st.integers(-(2**40), 2**40), junk)),
        st.tuples(st.just("size-of-bad"), st.one_of(st.integers(-(2**40), 2**40), junk)),
    ),
    max_size=60,
)


@cases(300)
@given(st.sampled_from([1, 512, 4096]), st.integers(1, 400_000), alloc_calls)
def test_allocator_invariants_hold_after_random_good_and_bad_calls(
    alignment: int, capacity: int, calls: list[tuple[str, Any]]
) -> None:
    capacity = max(capacity, alignment)
    alloc = OffsetAllocator(capacity, alignment)
    live: dict[int, int] = {}  #: offset -> the size asked for
    for op, arg in calls:
        state, changed = snapshot(alloc), False
        if op == "alloc":
            out = typed(PoolFull if good_size(arg) else ConfigError, alloc.allocate, arg)
            if isinstance(out, int):
                assert out not in live and out % alignment == 0
                live[out], changed = arg, True
        elif op == "free" and live:
            offset = sorted(live)[arg % len(live)]
            alloc.free(offset)
            del live[offset]
            changed = True
        elif op in ("free-bad", "size-of-bad"):
            out = typed(ConfigError, alloc.free if op == "free-bad" else alloc.size_of, arg)
            if type(arg) is int and arg in live:  # a live offset after all
                if op == "free-bad":
                    del live[arg]
                    changed = True
            else:
                assert isinstance(out, ConfigError) and "live allocation" in str(out)
        if not changed:
            assert snapshot(alloc) == state, f"{op}({arg!r}) changed the allocator"
        # no overlap, nothing outside the segment, and the books balance
        spans = sorted((o, alloc.size_of(o)) for o in live)
        assert all(a + sa <= b for (a, sa), (b, _) in pairwise(spans))
        assert all(o >= 0 and o + s <= alloc.capacity and s >= live[o] for o, s in spans)
        assert alloc.used == sum(s for _, s in spans) and alloc.used + alloc.free_bytes == alloc.capacity
        alloc.check_invariants()
    for offset in list(live):
        alloc.free(offset)
    assert alloc.used == 0 and alloc.largest_free == alloc.capacity, "space leaked"
    assert alloc.stats().free_extents == 1


# -- a node's chunk store: keys, lengths and checksums from clients --------------------------------------

BLOCK = 16 * 1024
STORE_KEYS = [i.to_bytes(32, "big") for i in range(6)]
store_calls = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from(STORE_KEYS), st.integers(1, 3 * BLOCK)),
        st.tuples(st.just("locate"), st.one_of(st.sampled_from(STORE_KEYS), key_values), st.none()),
        st.tuples(st.just("release"), st.one_of(st.sampled_from(STORE_KEYS), key_values), st.none()),
        st.tuples(st.just("remove"), st.one_of(st.sampled_from(STORE_KEYS), key_values), st.none()),
    ),
    max_size=25,
)


@pytest.fixture(scope="module")
def segments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DramSegment, NvmeSegment]]:
    where = tmp_path_factory.mktemp("segments")  # not /dev/shm: other test runs reap files there
    dram = DramSegment.create(8 * BLOCK, str(where))
    nvme = NvmeSegment.create(16 * BLOCK, str(where), direct=False)
    yield dram, nvme
    dram.close()
    nvme.close()


def store_state(store: ChunkStore) -> tuple[Any, ...]:
    return dict(store._chunks), store.holds.offsets(), [snapshot(a) for a in store.allocators.values()]


@cases(200)
@given(calls=store_calls)
def test_store_refuses_bad_calls_and_its_published_changes_match_its_chunks(
    segments: tuple[DramSegment, NvmeSegment], calls: list[tuple[str, Any, Any]]
) -> None:
    dram, nvme = segments
    store = ChunkStore(dram, nvme, watermarks=Watermarks(0.8, 0.5), alignment=4096)
    published: dict[bytes, tuple[Tier, int, int]] = {}  #: what etcd would hold: key -> (tier, offset, length)
    for op, key, arg in calls:
        before = store_state(store)
        if op == "put":
            out = typed((PoolFull, ConfigError), store.put, key, memoryview(bytes(arg)), 7)
        elif op == "locate":
            out = typed(ChunkNotFound, store.locate, key)
            if not isinstance(out, KvPoolError):
                store.release(key)
        elif op == "release":
            out = typed(ConfigError, store.release, key)
        elif op == "remove":
            out = typed(ChunkNotFound, store.remove, key)
        if isinstance(out, (ConfigError, ChunkNotFound)):  # PoolFull may have evicted on its way: allowed
            assert store_state(store) == before, f"refused {op}({key!r:.40}) changed the store"
        for change in store.take_changes():
            c = change.chunk
            if change.kind is ChangeKind.DROPPED:
                published.pop(c.key)
            else:
                published[c.key] = (c.tier, c.offset, c.stored)
        # etcd (the replayed change log) and the segments agree; the allocators are sound
        assert published == {c.key: (c.tier, c.offset, c.stored) for c in store.chunks()}
        for tier, alloc in store.allocators.items():
            alloc.check_invariants()
            held = [c.offset for c in store.chunks() if c.tier is tier] + (
                store.holds.offsets() if tier is Tier.DRAM else []
            )
            assert alloc.allocations == len(held)
            assert alloc.used == sum(alloc.size_of(offset) for offset in held)
    for c in store.chunks():
        store.remove(c.key)
    assert all(a.used == 0 for a in store.allocators.values()), "the store leaked space"


# -- records as stored in etcd -------------------------------------------------------------------------

NS = Namespace("bad-input")
KEY = bytes(range(32))
PLACEMENT = Placement(
    KEY,
    "node-1",
    Tier.NVME,
    offset=8192,
    stored=1024,
    size=4096,
    checksum=12345,
    codec="fp8",
    identity="0123456789abcdef",
)
NODE = NodeRecord("node-1", "host-a", 4242, b"agent", (SegmentInfo("dram0", Tier.DRAM, 1 << 20, 4096),), 1.0, "h:9100")
PLACEMENT_BYTES, NODE_BYTES = encode_placement(PLACEMENT), encode_node(NODE)

finite = st.one_of(st.integers(-(2**53), 2**53), st.floats(allow_nan=False, allow_infinity=False))
uint64 = st.integers(0, 2**64 - 1)
PLACEMENT_FIELDS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bool]]] = {
    # field -> (values to try, whether a value is acceptable)
    "tier": (st.one_of(st.sampled_from([t.value for t in Tier]), packable), lambda v: v in [t.value for t in Tier]),
    "offset": (st.one_of(uint64, packable), lambda v: type(v) is int and v >= 0),
    "stored": (st.one_of(uint64, packable), lambda v: type(v) is int and v >= 1),
    "size": (st.one_of(uint64, packable), lambda v: type(v) is int and v >= 1),
    "checksum": (st.one_of(uint64, packable), lambda v: type(v) is int and v >= 0),
    "codec": (packable, lambda v: isinstance(v, str)),
    "identity": (  # a cache identity's fingerprint, or "" for none
        st.one_of(st.sampled_from(["", "fedcba9876543210", "0123456789ABCDEF", "0123456789abcdef\n"]), packable),
        lambda v: isinstance(v, str) and re.fullmatch("([0-9a-f]{16})?", v) is not None,
    ),
}
NODE_FIELDS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bool]]] = {
    "host": (packable, lambda v: isinstance(v, str)),
    "pid": (st.one_of(st.integers(-10, 2**40), packable), lambda v: type(v) is int and 1 <= v < 2**31),
    "address": (packable, lambda v: isinstance(v, bytes)),
    "segments": (
        st.one_of(
            st.lists(
                st.tuples(st.text(max_size=6), st.sampled_from(["dram", "nvme", "tape"]), uint64, uint64).map(list)
            ),
            packable,
        ),
        lambda v: (
            isinstance(v, list)
            and all(
                isinstance(s, list)
                and len(s) == 4
                and isinstance(s[0], str)
                and s[1] in [t.value for t in Tier]
                and all(type(x) is int and x >= 0 for x in s[2:])
                for s in v
            )
        ),
    ),
    "started": (st.one_of(finite, packable), lambda v: type(v) in (int, float) and math.isfinite(v)),
    "metrics": (packable, lambda v: isinstance(v, str)),
}


@st.composite
def record_edit(
    draw: st.DrawFn, fields: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bool]]]
) -> tuple[str, str, Any]:
    """``(edit, field, value)``: drop a field, add an unknown one, change the version, or set a field."""
    edit = draw(st.sampled_from(["drop", "extra", "version", "set", "set"]))
    if edit == "drop":
        return edit, draw(st.sampled_from(["v", *fields])), None
    if edit == "extra":
        return edit, draw(st.text(max_size=8).filter(lambda k: k not in fields and k != "v")), draw(packable)
    if edit == "version":
        return edit, "v", draw(packable.filter(lambda v: v != SCHEMA_VERSION or type(v) is not int))
    name = draw(st.sampled_from(sorted(fields)))
    return edit, name, draw(fields[name][0])


def record_edits(fields: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bool]]]) -> st.SearchStrategy[Any]:
    return st.lists(record_edit(fields), min_size=1, max_size=2)


def apply_edits(encoded: bytes, edits: list[tuple[str, str, Any]]) -> dict[str, Any]:
    fields: dict[str, Any] = msgpack.unpackb(encoded)
    for edit, name, value in edits:
        if edit == "drop":
            fields.pop(name, None)
        else:
            fields[name] = value
    return fields


def well_formed(fields: dict[str, Any], spec: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bool]]]) -> bool:
    """Exactly ``"v"`` (this version, an int) and every field of ``spec``, each acceptable."""
    return (
        type(fields.get("v")) is int
        and fields["v"] == SCHEMA_VERSION
        and set(fields) == {"v", *spec}
        and all(ok(fields[n]) for n, (_, ok) in spec.items())
    )


def decoded_fields(raw: dict[str, Any], record: Any) -> None:
    """A record that decoded holds exactly the values of its map."""
    for name, value in raw.items():
        if name == "v":
            continue
        got: Any = getattr(record, name)
        got = got.value if isinstance(got, Tier) else got
        if name == "segments":
            got = [[s.name, s.tier.value, s.capacity, s.used] for s in got]
        assert got == (float(value) if isinstance(got, float) else value), (name, got, value)


@cases(500)
@given(record_edits(PLACEMENT_FIELDS))
def test_placement_with_a_wrong_schema_is_a_malformed_record(edits: list[tuple[str, str, Any]]) -> None:
    fields = apply_edits(PLACEMENT_BYTES, edits)
    ok = well_formed(fields, PLACEMENT_FIELDS)
    out = typed(MalformedRecord, decode_placement, KEY, "node-1", pack(fields))
    assert isinstance(out, Placement) == ok, (fields, out)
    if ok:
        decoded_fields(fields, out)
        assert decode_placement(KEY, "node-1", encode_placement(out)) == out
    else:
        assert str(out).startswith("placement")


@cases(300)
@given(record_edits(NODE_FIELDS))
def test_node_record_with_a_wrong_schema_is_a_malformed_record(edits: list[tuple[str, str, Any]]) -> None:
    fields = apply_edits(NODE_BYTES, edits)
    ok = well_formed(fields, NODE_FIELDS)
    out = typed(MalformedRecord, decode_node, "node-1", pack(fields))
    assert isinstance(out, NodeRecord) == ok, (fields, out)
    if ok:
        decoded_fields(fields, out)
        assert decode_node("node-1", encode_node(out)) == out
    else:
        assert str(out).startswith("node record")


@cases(1000)
@given(
    st.one_of(
        st.binary(max_size=120),
        packable.map(pack),
        st.binary(max_size=40).map(lambda b: PLACEMENT_BYTES + b),  # trailing garbage
        st.integers(1, 40).map(lambda n: PLACEMENT_BYTES[:-n]),  # truncated
        st.integers(1, 40).map(lambda n: NODE_BYTES[:-n]),
        junk,
    )
)
def test_random_bytes_are_malformed_records(raw: Any) -> None:
    for decode in (lambda r: decode_placement(KEY, "node-1", r), lambda r: decode_node("node-1", r)):
        out = typed(MalformedRecord, decode, raw)
        assert isinstance(out, (Placement, NodeRecord, MalformedRecord))
    if raw not in (PLACEMENT_BYTES, NODE_BYTES):
        assert isinstance(typed(MalformedRecord, decode_placement, KEY, "n", raw), MalformedRecord)


@cases(800)
@given(
    st.one_of(
        st.tuples(keys32, names).map(lambda t: NS.replica(*t)),
        st.tuples(keys32, names).map(lambda t: NS.chunks + t[0].hex().upper().encode() + b"/" + t[1].encode()),
        st.tuples(st.binary(max_size=40), st.binary(max_size=20)).map(
            lambda t: NS.chunks + t[0].hex().encode() + b"/" + t[1]
        ),
        st.tuples(keys32, st.binary(max_size=20)).map(lambda t: NS.chunks + t[0].hex().encode() + b"/" + t[1]),
        names.map(NS.node),
        st.binary(max_size=30).map(lambda b: NS.nodes + b),
        st.binary(max_size=100).map(lambda b: NS.chunks + b),
        st.binary(max_size=100),
        junk,
    )
)
def test_etcd_keys_parse_back_exactly_or_are_malformed(etcd_key: Any) -> None:
    replica = typed(MalformedRecord, NS.parse_replica, etcd_key)
    if isinstance(replica, tuple):
        assert NS.replica(*replica) == etcd_key  # a key parses only into what it was made from
    node = typed(MalformedRecord, NS.parse_node, etcd_key)
    if isinstance(node, str):
        assert NS.node(node) == etcd_key


# -- configs -------------------------------------------------------------------------------------------

sizes_with_units = st.sampled_from(["16GiB", "16 GB", "4096", "1e9", "16G", "512MiB", " 1 ", "-1"])
#: field -> (good values, bad values); a config built from good values only must construct
METADATA_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "endpoints": (
        st.lists(
            st.tuples(
                st.sampled_from(["", "http://"]),
                names.map(str.lower),
                st.integers(1, 65535),
            ).map(lambda t: f"{t[0]}{t[1]}:{t[2]}"),
            max_size=3,
        ).map(tuple),
        st.one_of(
            st.text(max_size=20),
            st.lists(st.one_of(st.none(), st.integers(), st.binary(max_size=5)), min_size=1, max_size=2).map(tuple),
            st.sampled_from(
                [("h:0",), ("h:65536",), ("h",), ("https://h:2379",), ("h:2379 x",), ("h:١٢",), None, 2379]
            ),
            st.text(max_size=20)
            .filter(lambda t: not re.fullmatch(r"\s*(https?://)?[\w.\-\[\]:]+:\d+/?\s*", t))
            .map(lambda t: (t,)),
        ),
    ),
    "cluster": (
        names,
        st.one_of(
            st.sampled_from(["", "a/b", "x" * 64, "-lead", "sp ace"]), junk.filter(lambda v: not isinstance(v, str))
        ),
    ),
    "lease_ttl_s": (st.integers(1, 3600), st.one_of(st.integers(-5, 0), st.sampled_from([True, 1.5, "5s", None]))),
    "request_timeout_s": (
        st.floats(0.001, 600),
        st.one_of(st.sampled_from([0, -1, math.nan, math.inf, True, "2s", None])),
    ),
    "retry_deadline_s": (
        st.integers(1, 600),
        st.one_of(st.sampled_from([0.0, -0.5, math.nan, -math.inf, False, "5", None])),
    ),
    "page_size": (st.integers(1, 10**6), st.one_of(st.integers(-5, 0), st.sampled_from([True, 10.0, "1000"]))),
    "txn_max_ops": (
        st.integers(1, 10_000),
        st.one_of(st.integers(10_001, 10**9), st.sampled_from([0, True, 1.5, "128"])),
    ),
}
SHM = tempfile.gettempdir()
POOL_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "metadata": (
        st.just(MetadataConfig()),
        st.one_of(st.none(), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.text(max_size=5)),
    ),
    "dram_bytes": (
        st.integers(0, 2**40),
        st.one_of(st.integers(-(2**40), -1), sizes_with_units, st.floats(), st.booleans(), st.none()),
    ),
    "nvme_bytes": (st.integers(-(2**40), 2**40), st.one_of(sizes_with_units, st.floats(), st.booleans(), st.none())),
    "shm_dir": (
        st.sampled_from(["/dev/shm", SHM]),
        st.one_of(st.sampled_from(["/no/such/dir", "", "/dev/null"]), st.none(), st.integers(), st.just(b"/dev/shm")),
    ),
    "nvme_dir": (
        st.sampled_from(["", SHM]),
        st.one_of(st.sampled_from(["/no/such/dir", "/dev/null"]), st.none(), st.integers(), st.just(b"/tmp")),
    ),
    "watermarks": (
        st.just(Watermarks()),
        st.one_of(st.none(), st.tuples(st.floats(), st.floats()), st.text(max_size=4)),
    ),
    "promote_on_hit": (st.booleans(), st.one_of(st.sampled_from(["yes", "false", 0, 1, None]))),
    "alignment": (
        st.integers(0, 20).map(lambda e: 1 << e),
        st.one_of(
            st.integers(-(2**20), 0),
            st.integers(3, 2**20).filter(lambda a: a & (a - 1) != 0),
            st.sampled_from([True, 4096.0, "4KiB"]),
        ),
    ),
    "namespace": (names, st.one_of(st.just(""), st.none(), st.integers(), st.binary(max_size=4))),
    "metrics_host": (
        st.sampled_from(["127.0.0.1", "0.0.0.0", "localhost"]),
        st.one_of(st.just(""), st.none(), st.integers()),
    ),
    "metrics_port": (
        st.integers(-1, 65535),
        st.one_of(st.integers(-(2**20), -2), st.integers(65536, 2**40), st.sampled_from([True, 80.0, "9100"])),
    ),
    "nvme_codec": (
        st.sampled_from(["raw", "fp8-e4m3", "fp8-e5m2/channel", "int4+zstd", "int4:g64+delta+zstd"]),
        st.one_of(st.sampled_from(["fp7", "", "int4+delta", "raw+delta+zstd", "int4:g3"]), st.none(), st.integers()),
    ),
    "remote": (st.just(RemoteConfig()), st.one_of(st.none(), st.text(max_size=4), st.just({"bucket": "kvpool"}))),
}
not_seconds = st.sampled_from([0, -1.0, math.nan, math.inf, "5s", None, True])
REMOTE_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "bucket": (
        st.sampled_from(["", "kvpool", "my.bucket-1"]),
        st.sampled_from(["AB", "a", "a..b", "-ab", "192.168.1.1", "x" * 64, None, 3]),
    ),
    "endpoint_url": (
        st.sampled_from(["", "http://127.0.0.1:8333", "https://s3.example.com"]),
        st.sampled_from(["ftp://host", "127.0.0.1:8333", "http://", None, 8333]),
    ),
    "prefix": (st.sampled_from(["kvpool", "a/b.c_d-e"]), st.sampled_from(["", "/a", "a//b", "a/..", "a b", None])),
    "region": (st.sampled_from(["", "eu-west-1"]), st.sampled_from(["us east", None, 1])),
    "access_key_id": (st.just(""), st.one_of(st.none(), st.integers(), st.text(min_size=1, max_size=4))),
    "secret_access_key": (st.just(""), st.one_of(st.none(), st.integers(), st.text(min_size=1, max_size=4))),
    "codec": (st.sampled_from(["raw", "int4+zstd"]), st.sampled_from(["fp7", "", None, 4])),
    "flush_after_s": (st.floats(0.001, 1e6), not_seconds),
    "promote_on_hit": (st.booleans(), st.sampled_from(["yes", 1, None])),
    "timeout_s": (st.floats(0.01, 100), not_seconds),
    "name": (st.sampled_from(["s3", "remote-1"]), st.sampled_from(["", "a/b", None, "x" * 64])),
}
WATERMARK_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "high": (
        st.floats(0.7, 1.0),
        st.one_of(
            st.floats(1.0001, 1e9), st.floats(max_value=0.0), st.just(math.nan), st.sampled_from(["80%", None, True])
        ),
    ),
    "low": (
        st.floats(0.01, 0.69),
        st.one_of(
            st.floats(max_value=0.0), st.floats(1.0, 1e9), st.just(math.nan), st.sampled_from(["60%", None, True])
        ),
    ),
}
WORKER_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "pool": (
        st.just(PoolConfig()),
        st.one_of(
            st.none(), st.just(MetadataConfig()), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
        ),
    ),
    "model": (
        st.sampled_from(["tiny-llama", "smollm2-135m"]),
        st.one_of(st.sampled_from(["", "gpt-9", "TINY-LLAMA"]), st.none(), st.integers()),
    ),
    "model_options": (
        st.lists(st.tuples(names, st.integers()), max_size=3).map(tuple),
        st.one_of(
            st.text(max_size=5).filter(bool),
            st.lists(st.tuples(st.integers(), st.integers()), min_size=1, max_size=2).map(tuple),
            st.lists(st.tuples(names, st.integers(), st.integers()), min_size=1, max_size=2).map(tuple),
            st.sampled_from([{"seed": 1}, [("seed",)], None, 5]),
        ),
    ),
    "chunk_size": (st.integers(1, 4096), st.one_of(st.integers(-4096, 0), st.sampled_from([True, 256.0, "256", None]))),
    "layout": (
        st.sampled_from(["auto", "all-layers", "per-layer", "groups-of-2"]),
        st.one_of(
            st.text(max_size=12).filter(
                lambda t: t not in ("auto", "all-layers", "per-layer") and not t.startswith("groups-of-")
            ),
            st.none(),
            st.just(["per-layer"]),
        ),
    ),
    "hardware": (
        st.none(),
        st.one_of(st.text(max_size=4), st.integers(), st.dictionaries(st.text(max_size=3), st.floats(), max_size=2)),
    ),
    "replicas": (st.integers(1, 16), st.one_of(st.integers(-16, 0), st.sampled_from([True, 2.0, "2", None]))),
    "torch_threads": (st.integers(0, 64), st.one_of(st.integers(-64, -1), st.sampled_from([True, 1.5, "4", None]))),
    "device_budget_mib": (
        st.integers(0, 2**20),
        st.one_of(st.integers(-(2**20), -1), st.sampled_from([True, 1.5, "1GiB", "16 GB", None])),
    ),
}


@st.composite
def config_draws(
    draw: st.DrawFn, example: Any, fields: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]
) -> tuple[dict[str, Any], str | None, Any]:
    """``(kwargs, bad field or None, its bad value)``: the fields of a good ``example``, a few of them redrawn
    from their good values, then maybe one of them bad."""
    names = sorted(fields)
    kwargs = {name: getattr(example, name) for name in names}
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        kwargs[name] = draw(fields[name][0])
    bad = draw(st.one_of(st.none(), st.sampled_from(names)))
    return kwargs, bad, draw(fields[bad][1]) if bad else None


CONFIGS: dict[str, tuple[Any, dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]]] = {
    # name -> (a good example, its fields)
    "MetadataConfig": (MetadataConfig(), METADATA_FIELDS),
    "PoolConfig": (PoolConfig(), POOL_FIELDS),
    "RemoteConfig": (RemoteConfig(), REMOTE_FIELDS),
    "Watermarks": (Watermarks(), WATERMARK_FIELDS),
    "WorkerConfig": (WorkerConfig(pool=PoolConfig()), WORKER_FIELDS),
}


@cases(600)
@given(st.data())
def test_configs_refuse_one_bad_field_naming_it(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(CONFIGS)))
    example, fields = CONFIGS[name]
    cls = type(example)
    kwargs, bad, value = data.draw(config_draws(example, fields))
    if bad is None:
        config = cls(**kwargs)
        assert all(getattr(config, k) == v or v != v for k, v in kwargs.items())
        return
    kwargs[bad] = value
    # A well-typed path to a directory this machine lacks is a SetupError (the machine, not the value, is at fault).
    missing = bad in {"shm_dir", "nvme_dir"} and isinstance(value, str) and value != ""
    err = refused(SetupError if missing else ConfigError, cls, **kwargs)
    assert bad in str(err) or (name == "Watermarks" and "watermarks" in str(err)), f"{err} does not name {bad}"


@cases(300)
@given(
    st.dictionaries(
        st.one_of(st.sampled_from([f.name for f in msgspec.structs.fields(MetadataConfig)]), names),
        st.integers(1, 50),
        max_size=3,
    ),
    st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=40),
)
def test_metadata_overrides_with_unknown_keys_and_bad_env_are_config_errors(
    overrides: dict[str, int], env: str
) -> None:
    known = {f.name for f in msgspec.structs.fields(MetadataConfig)}
    with mock.patch.dict(os.environ, {ENDPOINTS_ENV: env}):
        out = typed(ConfigError, MetadataConfig.from_env, **overrides)
    unknown = sorted(set(overrides) - known)
    if unknown:
        assert isinstance(out, ConfigError) and unknown[0] in str(out), (overrides, out)
    elif isinstance(out, MetadataConfig):
        assert all(getattr(out, k) == v for k, v in overrides.items())


# -- transfer descriptors ------------------------------------------------------------------------------

SCOPE = "bad-input"
NIXL_GOOD: dict[str, Any] = {
    "v": 1,
    "name": "agent-a",
    "scope": SCOPE,
    "agent": b"\x01meta",
    "regions": {"dram0": [4096, 1 << 20]},
}


def region_ok(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and _uint(v[0]) and _uint(v[1], 1)


def _uint(v: Any, lo: int = 0) -> bool:
    return type(v) is int and lo <= v < 2**63


DESCRIPTOR_FIELDS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bool]]] = {
    "v": (packable, lambda v: type(v) is int and v == 1),
    "name": (st.one_of(names, packable), lambda v: isinstance(v, str) and v != ""),
    "scope": (st.one_of(st.just(SCOPE), packable), lambda v: v == SCOPE),
    "agent": (st.one_of(st.binary(min_size=1, max_size=8), packable), lambda v: isinstance(v, bytes) and v != b""),
    "regions": (
        st.one_of(
            st.dictionaries(st.text(max_size=5), st.lists(st.integers(-5, 2**64 - 1), max_size=3), max_size=3),
            packable,
        ),
        lambda v: isinstance(v, dict) and all(isinstance(k, str) and k and region_ok(r) for k, r in v.items()),
    ),
}


@cases(500)
@given(st.data())
def test_transfer_descriptors_are_validated_before_any_agent_sees_them(data: st.DataObject) -> None:
    how, payload = data.draw(
        st.one_of(
            st.lists(record_edit(DESCRIPTOR_FIELDS), max_size=2).map(lambda e: ("edits", e)),
            st.one_of(st.binary(max_size=80), packable.map(pack), junk).map(lambda raw: ("raw", raw)),
        )
    )
    if how == "raw":
        out = typed(TransferError, nixl.parse_descriptor, payload, SCOPE)
        assert isinstance(out, TransferError) or payload == pack(NIXL_GOOD)
        return
    fields = dict(NIXL_GOOD)
    for edit, name, value in payload:
        if edit == "drop":
            fields.pop(name, None)
        else:
            fields[name] = value
    spec = DESCRIPTOR_FIELDS
    ok = set(fields) == set(spec) and all(spec[n][1](fields[n]) for n in spec)
    out = typed(TransferError, nixl.parse_descriptor, pack(fields), SCOPE)
    assert isinstance(out, TransferError) != ok, (fields, out)
    if ok:
        assert out == (fields["name"], fields["agent"], {k: tuple(r) for k, r in fields["regions"].items()})


OP_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "region": (names, st.one_of(st.just(""), st.none(), st.integers(), st.binary(max_size=4))),
    "remote_offset": (
        st.integers(0, 2**40),
        st.one_of(st.integers(-(2**40), -1), st.integers(2**64, 2**70), st.sampled_from([True, 1.0, "0", None])),
    ),
    "local_address": (
        st.integers(1, 2**47),
        st.one_of(st.integers(-(2**40), 0), st.integers(2**64, 2**70), st.sampled_from([True, 4096.0, "0x1000", None])),
    ),
    "length": (
        st.integers(1, 2**40),
        st.one_of(st.integers(-(2**40), 0), st.integers(2**64, 2**70), st.sampled_from([True, 1.0, "1", None])),
    ),
}
TRANSFER_ARGS: dict[str, tuple[Any, dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]]] = {
    "Op": (Op("dram0", 0, 4096, 1), OP_FIELDS),
}


@cases(400)
@given(st.data())
def test_transfer_ops_refuse_one_bad_field_naming_it(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(TRANSFER_ARGS)))
    example, fields = TRANSFER_ARGS[name]
    cls = type(example)
    kwargs, bad, value = data.draw(config_draws(example, fields))
    if bad is None:
        assert msgspec.structs.asdict(cls(**kwargs)) == kwargs
        return
    kwargs[bad] = value
    # A well-typed path to a directory this machine lacks is a SetupError (the machine, not the value, is at fault).
    missing = bad in {"shm_dir", "nvme_dir"} and isinstance(value, str) and value != ""
    err = refused(SetupError if missing else ConfigError, cls, **kwargs)
    assert bad in str(err), f"{err} does not name {bad}"
