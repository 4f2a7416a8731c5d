"""Chunk keys: a SHA-256 hash chain over fixed-size token chunks.

``H_0 = SHA-256(identity)`` and ``H_k = SHA-256(H_{k-1} || tokens of chunk k)``, so a key names a whole
prefix, not just one chunk: two prompts share key ``k`` exactly when their first ``k`` chunks agree.  The
identity folds in everything that changes the bytes of a KV chunk (model, dtype, layout, chunk size,
tensor-parallel shard, codec), so two caches that cannot be exchanged never share a key.  Nothing here
depends on the process, the host or ``PYTHONHASHSEED``: the same prompt gives the same keys everywhere.
"""

import hashlib
import json
from collections.abc import Mapping, Set
from typing import Annotated, Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from kvpool.core.config import Config, NonNegative, Positive, checked, validated
from kvpool.errors import ConfigError

KEY_BYTES = 32  #: chunk keys are SHA-256 digests
DEFAULT_CHUNK_SIZE = 256
_MAX_TOKEN_ID = 2**32 - 1  # tokens are hashed as little-endian uint32
#: one token id in a message (a request's prompt): what :func:`token_array` takes, as a declared type
TokenId = Annotated[int, msgspec.Meta(ge=0, le=_MAX_TOKEN_ID, description="a token id: an int in [0, 2**32)")]
_Layer = Annotated[int, msgspec.Meta(ge=0, le=_MAX_TOKEN_ID, description="an int in [0, 2**32)")]
_IDENTITY_TAG = "kvpool.cache-identity/1"
_Text = Annotated[str, msgspec.Meta(min_length=1, description="a non-empty string")]
#: a chunk key, as :func:`chunk_keys` makes them
ChunkKey = Annotated[
    bytes,
    msgspec.Meta(
        min_length=KEY_BYTES,
        max_length=KEY_BYTES,
        description=f"a {KEY_BYTES}-byte chunk key (kvpool.core.keys.chunk_keys makes them)",
    ),
]
#: a chunk key as ``kvpool ls`` shows it: its hex digits, surrounding whitespace ignored
ChunkKeyText = Annotated[
    str,
    msgspec.Meta(
        pattern=rf"^\s*[0-9a-fA-F]{{{2 * KEY_BYTES}}}\s*\Z",
        description=f"a chunk key: {2 * KEY_BYTES} hex digits (kvpool ls shows them)",
    ),
]
_Keys = list[ChunkKey]
_Items = list[tuple[ChunkKey, Any]]


class CacheIdentity(Config, frozen=True):
    """Everything that makes two KV caches exchangeable.

    ``layout`` names how a chunk's bytes are arranged, e.g. ``"all-layers:[L,2,T,H,D]"`` for a chunk
    that holds every layer, or ``"layer:[2,T,H,D]"`` for layer-wise chunks.
    """

    model: _Text
    kv_dtype: _Text
    layout: _Text
    chunk_size: Positive = DEFAULT_CHUNK_SIZE
    tp_size: Positive = 1
    tp_rank: NonNegative = 0
    codec: _Text = "raw"

    def check(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ConfigError(f"CacheIdentity.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")

    def root(self) -> bytes:
        """``H_0``: the SHA-256 of a canonical encoding of the identity."""
        canonical = json.dumps(
            {"tag": _IDENTITY_TAG, **msgspec.structs.asdict(self)}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).digest()


@runtime_checkable
class KeyScope(Protocol):
    """What roots a chain instead of the identity's own hash: a tenant's or a shared namespace's scope
    (:class:`kvpool.pool.tenants.Scope`, rooted in its secret).  The chain asks it only for ``H_0``."""

    def root(self, identity_root: bytes) -> bytes:
        """``H_0`` of this scope's chain for a cache whose identity hashes to ``identity_root``."""
        ...


_Scope = Annotated[KeyScope | None, msgspec.Meta(description="a Scope (Tenants.scope(tenant)) or None")]


def check_key(key: Any, field: str = "key") -> bytes:
    """``key`` if it is a chunk key (``KEY_BYTES`` bytes, as :func:`chunk_keys` makes them); ``ConfigError``
    naming ``field`` otherwise."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ConfigError(
            f"{field}: a chunk key is {KEY_BYTES} bytes (kvpool.core.keys.chunk_keys makes them), got {got} {key!r:.60}"
        )
    return key


def check_list(value: Any, field: str) -> list[Any]:
    """``value`` as a list if it is a list or tuple; ``ConfigError`` naming ``field`` otherwise."""
    return validated(list[Any], value, field)


def check_keys(keys: Any, field: str = "keys") -> list[bytes]:
    """``keys`` if it is a list of chunk keys; ``ConfigError`` naming ``field`` (and the index) otherwise."""
    return validated(_Keys, keys, field)


def check_items(items: Any, field: str = "items") -> list[tuple[bytes, Any]]:
    """``items`` if it is a list of ``(chunk key, data)`` pairs; ``ConfigError`` naming the bad one otherwise."""
    return validated(_Items, items, field)


def parse_key(text: Any, field: str = "key") -> bytes:
    """A :data:`ChunkKeyText` (``key.hex()``, as ``kvpool ls`` shows it) → its bytes; ``ConfigError`` naming
    ``field`` otherwise."""
    return bytes.fromhex(validated(ChunkKeyText, text, field).strip())


def token_array(tokens: Any, field: str = "tokens") -> np.ndarray:
    """Validate token ids and return them as a little-endian uint32 array (no copy when already one).

    Accepts an ordered collection of ints (list, tuple, range, iterator), a 1-D integer numpy array or a 1-D
    integer torch tensor.  Raises ``ConfigError`` naming ``field`` for non-integers, negative ids, ids above
    2**32-1, a wrong shape, or a container that holds no ordered ids (str, bytes, a set, a mapping).
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    if not isinstance(tokens, np.ndarray):
        if isinstance(tokens, (str, bytes, bytearray, memoryview, Mapping, Set)) or not hasattr(tokens, "__iter__"):
            raise ConfigError(
                f"{field} must be a sequence of int token ids, got {type(tokens).__name__} {tokens!r:.60}"
            )
        items = list(tokens)
        if not set(map(type, items)) <= {int}:  # one C-level pass; numpy ints as ints, for msgspec to check
            items = [int(t) if isinstance(t, np.integer) else t for t in items]
        return np.asarray(validated(list[TokenId], items, field), dtype="<u4")
    arr = tokens
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{field} must hold integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ConfigError(f"{field} must be 1-D, got shape {tuple(arr.shape)}")
    lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if not 0 <= lo <= hi <= _MAX_TOKEN_ID:
        i = int(arr.argmin() if lo < 0 else arr.argmax())
        raise ConfigError(
            f"{field}[{i}] is {int(arr[i])}: token ids are non-negative, up to the largest supported {_MAX_TOKEN_ID}"
        )
    return arr.astype("<u4", copy=False)


def next_key(previous: bytes, chunk_tokens: np.ndarray) -> bytes:
    """One link of the chain: ``SHA-256(previous || chunk tokens as little-endian uint32)``."""
    h = hashlib.sha256(previous)
    h.update(np.ascontiguousarray(chunk_tokens, dtype="<u4").tobytes())
    return h.digest()


@checked
def chunk_keys(identity: CacheIdentity, tokens: Any, scope: _Scope = None) -> list[bytes]:
    """The keys of every *full* chunk of ``tokens``; a trailing partial chunk gets no key.  ``scope``: a tenant's
    (or a shared namespace's) chain, rooted in its secret (:mod:`kvpool.pool.tenants`: ``Tenants.scope(tenant)``);
    None: the identity's own."""
    arr = token_array(tokens)
    c = identity.chunk_size
    keys: list[bytes] = []
    key = identity.root() if scope is None else scope.root(identity.root())
    for start in range(0, len(arr) - c + 1, c):
        key = next_key(key, arr[start : start + c])
        keys.append(key)
    return keys


def layer_key(chunk_key: bytes, layer: int) -> bytes:
    """The key of one layer of a chunk, for layer-wise layouts: ``SHA-256(H_k || "layer" || uint32 layer)``.

    Derived from the chunk's key, so a prefix hit on layer 0 names the same prefix on every layer.  Checked by hand:
    called per chunk and layer, where a declared check's microseconds would add up.
    """
    check_key(chunk_key, "chunk_key")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer <= _MAX_TOKEN_ID:
        layer = validated(_Layer, layer, "layer")  # only a bad layer pays for the declared check that words it
    return hashlib.sha256(chunk_key + b"layer" + layer.to_bytes(4, "little")).digest()
