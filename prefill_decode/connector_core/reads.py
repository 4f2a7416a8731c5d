"""Reads of the pool objects a load asked for, the same way for every engine: one ``get_into_batch``, and if it
fails, each object on its own, to learn which did not come (those are the engine's misses; the others landed,
verified)."""

from typing import Any

from kvpool.errors import KvPoolError


def read_each(client: Any, keys: list[bytes], buffers: list[Any]) -> set[int]:
    """Read ``keys`` into ``buffers`` (each a buffer, or the runs of memory one object lies in); the positions of
    those that did not come."""
    try:
        client.get_into_batch(keys, buffers)
        return set()
    except KvPoolError:  # find out which: each on its own
        missing = set()
        for i, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
            try:
                client.get_into(key, buffer)
            except KvPoolError:
                missing.add(i)
        return missing
