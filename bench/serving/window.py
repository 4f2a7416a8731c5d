"""What a layer below the engines could add on a window of the trace, before any engine starts
(``bench/serve.py --window``).

The scaled trace (the same requests ``bench/serve.py`` sends) replayed through ``--engines`` prefix caches of
``--engine-blocks`` blocks each, least recently used evicted first, as vLLM's own prefix cache evicts, and one global
prefix cache of chunks that never evicts (a layer large enough for the window), under round-robin and under
prefix-aware routing (the engine whose cache holds the longest prefix).  A request's leading blocks found in its
engine's cache are **own**; the whole chunks past them found in the global cache are **layer**: the most any layer
could serve, at each chunk size.  It counts blocks of hash ids, not tokens as the engines tokenize the prompts built
from them, and it ignores timing (a request's blocks are cached as it arrives, not once computed), so a real run
finds less: at the defaults it gives own 30 % and layer 6 % at 256-token chunks, where the engines measured own 30 %
and kvpool 0.5-0.8 % (docs/serving.md).  What it is for: finding a window where the layer below could matter at a
rate two cores serve, before spending an hour of engines on it.
"""

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ROUTINGS = ("round-robin", "prefix-aware")


@dataclass(frozen=True)
class Shares:
    """Of a window's prompt blocks: those an engine's own cache held, and those past them a global layer held."""

    own: float
    layer: float


def _held(cache: Any, keys: Sequence[tuple[int, ...]]) -> int:
    """How many of ``keys`` (a request's prefix chain) lead in ``cache``."""
    return sum(1 for _ in itertools.takewhile(lambda k: k in cache, keys))


def shares(hash_ids: Sequence[Sequence[int]], engines: int, blocks: int, chunk_blocks: int, routing: str) -> Shares:
    """Own and layer shares of the requests' blocks (``hash_ids``, in arrival order): ``engines`` caches of
    ``blocks`` blocks, a global cache of chunks of ``chunk_blocks`` blocks, ``routing`` of :data:`ROUTINGS`."""
    caches: list[OrderedDict[tuple[int, ...], None]] = [OrderedDict() for _ in range(engines)]
    layer: set[tuple[int, ...]] = set()
    own = below = total = 0
    for n, ids in enumerate(hash_ids):
        keys = [tuple(ids[: i + 1]) for i in range(len(ids))]
        held = [_held(c, keys) for c in caches]
        e = n % engines if routing == "round-robin" else max(range(engines), key=lambda i: held[i])
        whole = _held(layer, keys) // chunk_blocks * chunk_blocks
        own, below, total = own + held[e], below + max(0, whole - held[e]), total + len(keys)
        for key in keys:
            caches[e][key] = None
            caches[e].move_to_end(key)
            while len(caches[e]) > blocks:
                caches[e].popitem(last=False)
        layer.update(keys[: len(keys) // chunk_blocks * chunk_blocks])
    return Shares(own / total, below / total) if total else Shares(0.0, 0.0)


def table(rows: list[dict[str, Any]], engines: int, blocks: int, hash_block: int, chunks: Sequence[int]) -> str:
    """The shares of the scaled trace's ``rows`` per routing and chunk size (tokens), one line each."""
    ids = [r["hash_ids"] for r in rows]
    span_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0
    tokens = sum(r["input_length"] for r in rows)
    lines = [
        f"{len(rows)} requests, {tokens:,} prompt tokens over {span_s:.0f} s ({len(rows) / max(span_s, 1e-9):.2f} "
        f"req/s, {tokens / max(span_s, 1e-9):.0f} prompt tokens/s); {engines} engines of {blocks} blocks"
    ]
    for routing, chunk in itertools.product(ROUTINGS, chunks):
        s = shares(ids, engines, blocks, max(1, chunk // hash_block), routing)
        lines.append(
            f"  {routing:12} chunks of {chunk:4} tokens: own cache {s.own:4.0%}, layer below at most {s.layer:4.0%}"
        )
    return "\n".join(lines)
