import contextlib
import hashlib
import math
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.core.keys import layer_key
from kvpool.errors import ChunkNotFound, ConfigError, UndecodableChunk, UnencodableTensor
from kvpool.pool.tiers.codecs import MAGIC, Codec, codec_key, decode, parse_codec, read_header
from kvpool.pool.tiers.quantizers import Fp8, Int4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPECS = [
    "raw",
    "raw+zstd",
    "fp8-e4m3",
    "fp8-e4m3/channel",
    "fp8-e5m2",
    "fp8-e5m2/channel+zstd",
    "int4",
    "int4:g64",
    "int4:g48",
    "int4+zstd",
    "int4+delta+zstd",
]
LOSSY = [s for s in SPECS if not s.startswith("raw")]
#: the rounding of a decoded value to the output dtype: relative to its magnitude, and at least (subnormals)
OUT_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
OUT_FLOOR = {torch.float32: 0.0, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-25}


def kv(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """KV-like data: normal values, a few outlier channels ten times larger, a per-channel offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.ndim >= 2 and shape[-1] >= 4:
        x[..., :: max(shape[-1] // 4, 1)] *= 10
        x += torch.randn(shape[-1], generator=g)
    return x.to(dtype)


def with_output_rounding(bound: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``bound`` plus the rounding of the decoded value (at most ``|x| + bound``) to the output dtype."""
    return bound + OUT_EPS[out_dtype] * (x.float().abs() + bound) * 1.01 + OUT_FLOOR[out_dtype]


def fp8_bound(x: torch.Tensor, spec: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Per value: half an ulp of the fp8 format relative to |x|, plus its subnormal floor, plus output rounding."""
    if x.numel() == 0:
        return x.float()
    e4m3 = "e4m3" in spec
    rel, top, floor = (2.0**-4, 448.0, 2.0**-10) if e4m3 else (2.0**-3, 57344.0, 2.0**-17)
    xf = x.float()
    amax = xf.abs().amax(dim=0) if "/channel" in spec and xf.ndim >= 2 else xf.abs().amax()
    return with_output_rounding(rel * xf.abs() * 1.0001 + floor * amax / top + 1e-30, x, out_dtype)


def int4_bound(x: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Per value: half the group's step, step = (max - min) / 15 with min rounded down and step rounded up to
    float16 (by up to two ulps, 2**-9 relative, each), plus output rounding."""
    if x.numel() == 0:
        return x.float()
    d = x.shape[-1]
    group = min(group, d + d % 2)  # a group never spans two heads
    rows = x.float().reshape(-1, d)
    pad = -d % group
    padded = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1) if pad else rows
    groups = padded.view(rows.shape[0], -1, group)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    amax = torch.maximum(lo.abs(), hi.abs())
    half_step = ((hi - lo) + amax * 2.0**-9) / 30 * (1 + 2.0**-9) + 1e-7
    bound = (half_step + 1e-6 * amax).expand_as(groups).reshape(rows.shape[0], -1)[:, :d]
    return with_output_rounding(bound.reshape(x.shape), x, out_dtype)


def check_round_trip(spec: str, x: torch.Tensor) -> torch.Tensor:
    codec = parse_codec(spec)
    y = codec.decode(codec.encode(x))
    assert y.dtype == x.dtype and y.shape == x.shape
    if codec.lossless:
        assert torch.equal(y.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))  # bit exact, NaN too
        return y
    err = (y.float() - x.float()).abs()
    base = spec.split("+")[0]
    if base.startswith("fp8"):
        bound = fp8_bound(x, base, x.dtype)
    else:
        bound = int4_bound(x, codec.quantizer.group if isinstance(codec.quantizer, Int4) else 0, x.dtype)
    assert bool((err <= bound).all()), f"{spec}: error {float((err - bound).max()):.3g} over the bound"
    return y


# round trips


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_within_bound(spec: str, dtype: torch.dtype) -> None:
    check_round_trip(spec, kv((64, 2, 3, 64), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_is_the_tensor_bytes_after_the_header(dtype: torch.dtype) -> None:
    x = kv((16, 2, 2, 8), dtype)
    data = parse_codec("raw").encode(x)
    header = read_header(data)
    assert data[header.body_offset :] == x.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("base", ["raw", "fp8-e4m3", "fp8-e5m2/channel", "int4", "int4:g64"])
def test_zstd_stages_are_lossless_over_their_base(base: str) -> None:
    x = kv((128, 2, 3, 64), torch.bfloat16, seed=3)
    plain = parse_codec(base).decode(parse_codec(base).encode(x))
    stacked = [f"{base}+zstd"] + ([f"{base}+delta+zstd"] if base.startswith("int4") else [])
    for spec in stacked:
        y = parse_codec(spec).decode(parse_codec(spec).encode(x))
        assert torch.equal(y.view(torch.uint8), plain.view(torch.uint8)), spec


def test_zstd_compresses_redundant_kv() -> None:
    x = torch.zeros(256, 2, 3, 64).index_fill_(3, torch.arange(0, 64, 2), 1.5)
    raw, packed = parse_codec("raw").encode(x), parse_codec("raw+zstd").encode(x)
    assert len(packed) < len(raw) / 50


def test_sizes() -> None:
    x = kv((256, 2, 3, 64), torch.float16)
    n = x.numel()
    header = read_header(parse_codec("raw").encode(x)).body_offset
    assert len(parse_codec("fp8-e4m3").encode(x)) - read_header(parse_codec("fp8-e4m3").encode(x)).body_offset == n + 4
    fp8c = parse_codec("fp8-e4m3/channel").encode(x)
    assert len(fp8c) - read_header(fp8c).body_offset == n + 4 * 2 * 3 * 64
    int4 = parse_codec("int4").encode(x)  # 4 bits a value, a float16 min and step per 32 values, one width byte
    assert len(int4) - read_header(int4).body_offset == n // 2 + 1 + 2 * 2 * (n // 32)
    assert header < 80


def test_per_channel_scales_protect_small_channels() -> None:
    """One huge channel pushes the others into fp8's subnormals under a per-tensor scale, not a per-channel one."""
    x = torch.randn(256, 2, 64, generator=torch.Generator().manual_seed(0))
    x[:, :, 0] *= 1e5
    errors = {}
    for spec in ("fp8-e4m3", "fp8-e4m3/channel"):
        y = parse_codec(spec).decode(parse_codec(spec).encode(x))
        errors[spec] = float((y - x)[:, :, 1:].abs().mean())
    assert errors["fp8-e4m3/channel"] < errors["fp8-e4m3"] / 10


def test_encode_is_deterministic_and_takes_views() -> None:
    x = kv((2, 3, 64, 32)).permute(2, 0, 1, 3)  # [64, 2, 3, 32], not contiguous
    for spec in SPECS:
        codec = parse_codec(spec)
        assert codec.encode(x) == codec.encode(x.contiguous()), spec


# odd shapes


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(
    "shape", [(0, 2, 3, 64), (4, 0), (0,), (5,), (1, 1), (7, 33), (3, 2, 5), (2, 2, 96), (1,) * 16], ids=str
)
def test_odd_and_empty_shapes(spec: str, shape: tuple[int, ...]) -> None:
    check_round_trip(spec, kv(shape, torch.bfloat16))


def test_int4_pads_a_head_dim_the_group_does_not_divide() -> None:
    x = kv((8, 33))  # int4:g32: groups of 32 and of 1 (padded with copies of the last value)
    y = check_round_trip("int4", x)
    lone = x[:, 32]
    assert bool(((y[:, 32] - lone).abs() <= lone.abs() * 2.0**-10 + 1e-7).all())  # min == max: only float16 rounding


def test_int4_groups_never_span_two_heads() -> None:
    x = kv((64, 2, 32))

    def body(spec: str, t: torch.Tensor) -> int:
        data = parse_codec(spec).encode(t)
        return len(data) - read_header(data).body_offset

    assert body("int4:g128", x) == body("int4:g64", x) == body("int4", x)  # head dim 32: one group per head
    assert torch.equal(decode(parse_codec("int4:g128").encode(x)), decode(parse_codec("int4").encode(x)))
    odd = kv((64, 2, 7))  # one group of 8 (7 values and a copy of the last) per head
    assert body("int4", odd) == 1 + 64 * 2 * (2 * 2 + 8 // 2)
    check_round_trip("int4", odd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_and_zero_tensors(dtype: torch.dtype) -> None:
    for spec in SPECS:
        zeros = torch.zeros(4, 2, 64, dtype=dtype)
        assert torch.equal(parse_codec(spec).decode(parse_codec(spec).encode(zeros)), zeros), spec
        check_round_trip(spec, torch.full((4, 2, 64), -2.5, dtype=dtype))


def test_int4_offset_groups_and_float32_parameters() -> None:
    offset = kv((16, 64)) * 0.01 + 1000  # a narrow range far from zero: the min's float16 rounding shows
    check_round_trip("int4", offset)
    wide = kv((16, 64)) * 30000  # beyond float16's range for the parameters
    check_round_trip("int4", wide)
    body = parse_codec("int4").encode(wide)
    assert body[read_header(body).body_offset] == 4  # float32 parameters
    body = parse_codec("int4").encode(offset)
    assert body[read_header(body).body_offset] == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(SPECS),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=4).map(tuple),
    magnitude=st.sampled_from([1e-6, 1.0, 300.0, 5e4]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(
    spec: str, dtype: torch.dtype, shape: tuple[int, ...], magnitude: float, seed: int
) -> None:
    x = (kv(shape, seed=seed) * magnitude).clamp(-6e4, 6e4).to(dtype)  # within float16's range
    check_round_trip(spec, x)


# headers


def test_header_describes_the_chunk() -> None:
    x = kv((32, 2, 3, 64), torch.bfloat16)
    data = parse_codec("INT4:G64+ZSTD").encode(x)
    assert data.startswith(MAGIC)
    header = read_header(data)
    assert (header.codec, header.dtype, header.shape) == ("int4:g64+zstd", "bfloat16", (32, 2, 3, 64))
    assert header.body_offset + header.body_length == len(data)
    y = decode(data)  # no codec given: the header names it
    assert torch.equal(y, parse_codec("int4:g64").decode(parse_codec("int4:g64").encode(x)))


def test_decode_takes_bytearray_and_memoryview() -> None:
    x = kv((8, 64))
    data = parse_codec("fp8-e4m3+zstd").encode(x)
    expect = decode(data)
    assert torch.equal(decode(bytearray(data)), expect)
    assert torch.equal(decode(memoryview(b"pad" + data)[3:]), expect)


# specs


@pytest.mark.parametrize(
    "spec,name",
    [
        ("raw", "raw"),
        ("zstd", "raw+zstd"),
        (" RAW+ZSTD ", "raw+zstd"),
        ("fp8-e4m3/tensor", "fp8-e4m3"),
        ("fp8-e5m2/channel+zstd", "fp8-e5m2/channel+zstd"),
        ("int4:g32", "int4"),
        ("int4:g64", "int4:g64"),
        ("int4:g2+delta+zstd", "int4:g2+delta+zstd"),
    ],
)
def test_specs_are_canonicalised(spec: str, name: str) -> None:
    codec = parse_codec(spec)
    assert codec.name == str(codec) == name
    assert parse_codec(codec.name) == codec


def test_codec_objects_match_their_specs() -> None:
    assert parse_codec("int4:g64+delta+zstd") == Codec(Int4(64), delta=True, zstd=True)
    assert parse_codec("fp8-e5m2/channel") == Codec(Fp8("e5m2", per_channel=True))
    assert parse_codec("raw").lossless and parse_codec("raw+zstd").lossless and not parse_codec("int4+zstd").lossless


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "foo",
        "fp8",
        "fp8-e4m3/row",
        "fp8-e3m4",
        "int8",
        "int4:g0",
        "int4:g3",
        "int4:g-2",
        "int4:gx",
        "int4:32",
        "int4:g8192",
        "int4:g",
        "raw+lz4",
        "raw+zstd+zstd",
        "zstd+raw",
        "zstd+zstd",
        "int4+delta",
        "fp8-e4m3+delta+zstd",
        "raw+delta+zstd",
        "int4+zstd+delta",
        "+zstd",
    ],
)
def test_bad_specs_raise_config_error(spec: str) -> None:
    with pytest.raises(ConfigError):
        parse_codec(spec)


@pytest.mark.parametrize("make", [lambda: Int4(3), lambda: Int4(0), lambda: Fp8("e3m4"), lambda: Codec(Int4(), True)])
def test_bad_codec_objects_raise_config_error(make: object) -> None:
    with pytest.raises(ConfigError):
        make()  # type: ignore[operator]


@pytest.mark.parametrize("spec", [None, 4, b"raw"])
def test_spec_must_be_a_string(spec: object) -> None:
    with pytest.raises(ConfigError, match=r"codec spec must be a string \(raw \| .*\(expected `str`\)"):
        parse_codec(spec)  # type: ignore[arg-type]


# bad input


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(4, 8, dtype=torch.float64),
        torch.zeros(4, 8, dtype=torch.int8),
        torch.zeros(4, 8, dtype=torch.bool),
        torch.zeros(4, 8, dtype=torch.float8_e4m3fn),
        torch.tensor(1.0),
        torch.zeros((1,) * 17),
        np.zeros((4, 8), dtype=np.float32),
        [[1.0, 2.0]],
    ],
    ids=["float64", "int8", "bool", "float8", "0-d", "17-d", "numpy", "list"],
)
def test_unencodable_input(spec: str, tensor: object) -> None:
    with pytest.raises(UnencodableTensor):
        parse_codec(spec).encode(tensor)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values(bad: float) -> None:
    x = kv((8, 2, 64))
    x[3, 1, 7] = bad
    for spec in LOSSY:
        with pytest.raises(UnencodableTensor, match="NaN or inf"):
            parse_codec(spec).encode(x)
    for spec in ("raw", "raw+zstd"):
        check_round_trip(spec, x)  # kept bit for bit


def test_int4_group_beyond_float32_range() -> None:
    x = torch.tensor([[3e38, -3e38, 1.0, 2.0]])  # max - min overflows float32
    with pytest.raises(UnencodableTensor, match="range"):
        parse_codec("int4").encode(x)
    check_round_trip("fp8-e4m3", x)


# corrupt bytes


def encoded(spec: str) -> bytes:
    return parse_codec(spec).encode(kv((8, 2, 2, 32), torch.float16, seed=1))


@pytest.mark.parametrize("spec", SPECS)
def test_truncated_bytes_are_undecodable(spec: str) -> None:
    data = encoded(spec)
    for n in range(len(data)):
        with pytest.raises(UndecodableChunk):
            decode(data[:n])
    with pytest.raises(UndecodableChunk):
        decode(data + b"\0")


@pytest.mark.parametrize("spec", ["raw+zstd", "fp8-e4m3+zstd", "int4+zstd", "int4+delta+zstd"])
def test_corrupt_zstd_frames_are_caught(spec: str) -> None:
    """zstd's content checksum: a flipped bit in the frame is an error, or a bit zstd ignores (the frame
    header's unused flag, say) -- never different data."""
    data = encoded(spec)
    expect = decode(data)
    offset = read_header(data).body_offset
    caught = 0
    for i in range(offset, len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x10
        try:
            assert torch.equal(decode(flipped), expect), f"byte {i - offset} of the frame changed the data"
        except UndecodableChunk:
            caught += 1
    assert caught >= len(data) - offset - 4


def test_undecodable_is_a_miss() -> None:
    assert issubclass(UndecodableChunk, ChunkNotFound)
    with pytest.raises(ChunkNotFound):
        decode(b"not a chunk")


def test_header_corruptions() -> None:
    data = encoded("int4")
    header = read_header(data)
    name_at = 5
    shape_at = name_at + len(header.codec) + 2

    def patched(at: int, new: bytes) -> bytes:
        return data[:at] + new + data[at + len(new) :]

    cases = {
        "magic": patched(0, b"KVD"),
        "version": patched(3, b"\x02"),
        "unknown codec": patched(name_at, b"intx"),
        "non-ascii name": patched(name_at, b"\xff"),
        "dtype code": patched(shape_at - 2, b"\x09"),
        "no dims": patched(shape_at - 1, b"\x00"),
        "17 dims": patched(shape_at - 1, b"\x11"),
        "shape": patched(shape_at, struct.pack("<Q", 9)),
        "huge shape": patched(shape_at, struct.pack("<Q", 2**60)),
        "body length": patched(shape_at + 8 * len(header.shape), struct.pack("<Q", header.body_length + 1)),
        "int4 parameter width": patched(header.body_offset, b"\x03"),
    }
    for what, bad in cases.items():
        with pytest.raises(UndecodableChunk):
            decode(bad)
        assert what


def test_decoding_with_another_codec_is_refused() -> None:
    with pytest.raises(UndecodableChunk, match="int4"):
        parse_codec("fp8-e4m3").decode(encoded("int4"))


def test_zstd_size_claims_are_bounded() -> None:
    x = torch.zeros(4, 64)
    data = parse_codec("raw+zstd").encode(x)
    header = read_header(data)
    # claim a huge shape: the frame's content size no longer fits it, nothing large is allocated
    bigger = data.replace(struct.pack("<QQ", 4, 64), struct.pack("<QQ", 2**40, 64), 1)
    assert bigger != data and read_header(bigger).shape == (2**40, 64)
    with pytest.raises(UndecodableChunk):
        decode(bigger)
    assert header.body_length < 64


@settings(max_examples=300, deadline=None)
@given(spec=st.sampled_from(SPECS), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4))
def test_any_corruption_decodes_or_raises_undecodable(spec: str, edits: list[tuple[int, int]]) -> None:
    data = bytearray(encoded(spec))
    for at, value in edits:
        data[at % len(data)] = value
    try:
        y = decode(data)
    except UndecodableChunk:
        return
    assert isinstance(y, torch.Tensor)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_after_the_magic(tail: bytes) -> None:
    with contextlib.suppress(UndecodableChunk):
        decode(MAGIC + tail)


# identity


def test_codec_key() -> None:
    key = hashlib.sha256(b"chunk").digest()
    assert codec_key(key, "raw") == key == codec_key(key, parse_codec("raw"))
    assert codec_key(key, "int4") == hashlib.sha256(key + b"codec" + b"int4").digest()
    assert codec_key(key, "INT4:g32") == codec_key(key, parse_codec("int4"))
    names = ["raw", "raw+zstd", "fp8-e4m3", "fp8-e4m3/channel", "fp8-e5m2", "int4", "int4:g64", "int4+delta+zstd"]
    keys = {codec_key(key, name) for name in names} | {layer_key(key, 0)}
    assert len(keys) == len(names) + 1
    assert codec_key(layer_key(key, 1), "int4") != codec_key(layer_key(key, 2), "int4")
    with pytest.raises(ConfigError):
        codec_key(key, "int3")
    for bad in (b"short", key.hex(), None):
        with pytest.raises(ConfigError, match="chunk_key"):
            codec_key(bad, "int4")  # type: ignore[arg-type]


def test_threads_share_codecs() -> None:
    chunks = [kv((64, 2, 2, 64), seed=i) for i in range(16)]
    codec = parse_codec("int4+delta+zstd")
    expect = [codec.decode(codec.encode(c)) for c in chunks]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: codec.decode(codec.encode(c)), chunks * 4))
    assert all(torch.equal(g, e) for g, e in zip(got, expect * 4, strict=True))
