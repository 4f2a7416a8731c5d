import hashlib
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.keys import CacheIdentity, chunk_keys, next_key, token_array

ID = CacheIdentity(model="llama-test", kv_dtype="bfloat16", layout="all-layers:[L,2,T,H,D]", chunk_size=4)


def test_chain_definition() -> None:
    tokens = list(range(10))
    keys = chunk_keys(ID, tokens)
    assert len(keys) == 2  # 10 tokens, chunks of 4: the trailing 2 get no key
    h0 = ID.root()
    h1 = hashlib.sha256(h0 + np.arange(0, 4, dtype="<u4").tobytes()).digest()
    h2 = hashlib.sha256(h1 + np.arange(4, 8, dtype="<u4").tobytes()).digest()
    assert keys == [h1, h2]
    assert next_key(h1, np.arange(4, 8)) == h2


def test_partial_chunk_only_gets_no_key() -> None:
    assert chunk_keys(ID, [1, 2, 3]) == []
    assert chunk_keys(ID, []) == []


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_keys_name_prefixes(a: list[int], b: list[int]) -> None:
    """Key k of two prompts agrees exactly when their first k chunks agree."""
    ka, kb = chunk_keys(ID, a), chunk_keys(ID, b)
    for k in range(min(len(ka), len(kb))):
        assert (ka[k] == kb[k]) == (a[: 4 * (k + 1)] == b[: 4 * (k + 1)])


def test_input_types_agree() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    expect = chunk_keys(ID, tokens)
    assert chunk_keys(ID, tuple(tokens)) == expect
    assert chunk_keys(ID, np.array(tokens, dtype=np.int32)) == expect
    assert chunk_keys(ID, torch.tensor(tokens)) == expect


@pytest.mark.parametrize(
    "field,value",
    [("model", "other"), ("kv_dtype", "float16"), ("layout", "layer:[2,T,H,D]"), ("tp_size", 2), ("codec", "fp8")],
)
def test_identity_separates_caches(field: str, value: object) -> None:
    other = msgspec.structs.replace(ID, **{field: value})
    assert chunk_keys(other, range(8)) != chunk_keys(ID, range(8))
    assert other.root() != ID.root()


@pytest.mark.parametrize(
    "tokens,field",
    [
        ([1, 2.5, 3], r"tokens\[1\]"),
        ([1, "2"], r"tokens\[1\]"),
        ([True, 2], r"tokens\[0\]"),
        ([1, -4, 2], r"tokens\[1\] must be a token id: an int in \[0, 2\*\*32\), got int -4"),
        (np.array([1, -4, 2]), r"tokens\[1\] is -4: token ids are non-negative"),
        (np.array([1.0, 2.0]), "integer"),
        (np.array([[1, 2]]), "1-D"),
        ([2**32], r"tokens\[0\] must be a token id: an int in \[0, 2\*\*32\), got int 4294967296"),
        (np.array([2**32]), "largest supported"),
    ],
)
def test_bad_tokens_name_the_field(tokens: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        chunk_keys(ID, tokens)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": -3}, "chunk_size"),
        ({"chunk_size": 2.0}, "chunk_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": 1}, "tp_rank"),
        ({"model": ""}, "model"),
    ],
)
def test_bad_identity_names_the_field(kwargs: dict[str, object], field: str) -> None:
    base = {"model": "m", "kv_dtype": "bf16", "layout": "all"}
    with pytest.raises(ValueError, match=field):
        CacheIdentity(**{**base, **kwargs})  # type: ignore[arg-type]


def test_token_array_keeps_uint32_without_copy() -> None:
    arr = np.arange(16, dtype="<u4")
    assert token_array(arr) is arr


_CHILD = """
import sys
from kvpool.core.keys import CacheIdentity, chunk_keys
ident = CacheIdentity(model="llama-test", kv_dtype="bfloat16", layout="all-layers", chunk_size=256)
print(",".join(k.hex() for k in chunk_keys(ident, range(1000, 1000 + 256 * 5 + 17))))
"""


def test_keys_agree_across_processes() -> None:
    """Different processes (and different hash seeds) compute the same keys."""
    outs = [
        subprocess.run(
            [sys.executable, "-c", _CHILD], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout.strip()
        for seed in ("1", "2")
    ]
    assert outs[0] == outs[1]
    ident = CacheIdentity(model="llama-test", kv_dtype="bfloat16", layout="all-layers", chunk_size=256)
    assert outs[0].split(",") == [k.hex() for k in chunk_keys(ident, range(1000, 1000 + 256 * 5 + 17))]
    assert len(outs[0].split(",")) == 5


def test_the_public_path_still_imports_the_keys() -> None:
    """``kvpool.pool.keys`` (README's path) re-exports the chunk keys of ``kvpool.core.keys``: the same objects."""
    import kvpool.core.keys as core
    import kvpool.pool.keys as public
    from kvpool.pool.keys import CacheIdentity as PublicIdentity
    from kvpool.pool.keys import chunk_keys as public_chunk_keys

    assert PublicIdentity is CacheIdentity and public_chunk_keys is chunk_keys
    assert public.__all__ and all(getattr(public, name) is getattr(core, name) for name in public.__all__)
