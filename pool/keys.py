"""Chunk keys, at the path users import them from; the code lives in :mod:`kvpool.core.keys`.

``from kvpool.pool.keys import CacheIdentity, chunk_keys`` keeps working; code inside kvpool imports
:mod:`kvpool.core.keys`.
"""

from kvpool.core.keys import (
    DEFAULT_CHUNK_SIZE,
    KEY_BYTES,
    CacheIdentity,
    check_items,
    check_key,
    check_keys,
    check_list,
    chunk_keys,
    layer_key,
    next_key,
    parse_key,
    token_array,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "KEY_BYTES",
    "CacheIdentity",
    "check_items",
    "check_key",
    "check_keys",
    "check_list",
    "chunk_keys",
    "layer_key",
    "next_key",
    "parse_key",
    "token_array",
]
