"""The Mooncake FAST'25 request traces as kvpool sees them: requests on the trace's clock, each block of the trace's
``hash_ids`` turned into kvpool chunk keys by the pool's own hash chain (``kvpool.core.keys.chunk_keys``).

A trace line is ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``, one id per block of 512
tokens; equal ids mean an equal prefix.  The traces carry no tokens, so each block gets deterministic tokens derived
from its id (:func:`block_tokens`): equal ids give equal tokens, hence equal chain keys, and two requests share
exactly as many leading keys as their ids agree on.  Every block counts as a whole block (the trace's last block of
a prompt is usually partial), as the README's infinite-cache hit rates count them.

``copies``: the trace served ``n`` times over by independent tenants (each copy keyed under its own cache identity,
so no key is shared between copies), interleaved on the trace's clock: traffic for a fleet ``n`` times larger.
"""

import json
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.errors import ConfigError

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "mooncake-fast25"
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
BLOCK_TOKENS = 512  #: tokens per trace block (the README)
#: what the README reports of each trace: the hit rate of an infinite cache over blocks
README_CEILING = {"conversation": 0.366, "synthetic": 0.640}


@dataclass(frozen=True)
class Request:
    t_s: float  #: arrival, seconds from the trace's start
    input_tokens: int  #: the prompt's tokens as the trace says (its blocks hold ``blocks * block tokens``)
    output_tokens: int
    hash_ids: tuple[int, ...]
    keys: list[bytes] = field(repr=False)  #: the chunk keys of its blocks, in chain order
    copy: int = 0  #: which tenant's copy of the trace (see ``copies``)

    @property
    def blocks(self) -> int:
        return len(self.hash_ids)


def trace_path(name: str, data: Path = DATA) -> Path:
    return data / TRACES[name]


def identity(chunk_tokens: int, copy: int = 0) -> CacheIdentity:
    """The cache identity the fleet's chunks are keyed under: LLaMA3-70B's KV (bf16, all layers in a chunk); a copy of
    the trace is another tenant's model name, so its keys never meet the other copies'."""
    model = "llama-3-70b" if copy == 0 else f"llama-3-70b/copy-{copy}"
    return CacheIdentity(model, "bfloat16", "all-layers:[L,2,T,H,D]", chunk_size=chunk_tokens)


def block_tokens(hash_id: int, tokens: int) -> np.ndarray:
    """The deterministic tokens of block ``hash_id``: ``tokens`` consecutive ids starting at ``hash_id * tokens``
    (mod 2**32), so distinct blocks of a trace (fewer than 2**32 / tokens ids) never share tokens."""
    start = (hash_id * tokens) % 2**32
    return ((np.arange(tokens, dtype=np.uint64) + start) % 2**32).astype("<u4")


def request_keys(hash_ids: tuple[int, ...], tokens_per_block: int, chunk_tokens: int, copy: int = 0) -> list[bytes]:
    """The chunk keys of a request's blocks (``tokens_per_block / chunk_tokens`` chunks a block)."""
    if not hash_ids:
        return []
    tokens = np.concatenate([block_tokens(h, tokens_per_block) for h in hash_ids])
    return chunk_keys(identity(chunk_tokens, copy), tokens)


def load(
    name: str,
    *,
    limit: int | None = None,
    span_s: float | None = None,
    tokens_per_block: int = BLOCK_TOKENS,
    chunk_tokens: int = BLOCK_TOKENS,
    copies: int = 1,
    data: Path = DATA,
) -> list[Request]:
    """The first ``limit`` requests (or those of the first ``span_s`` seconds) of trace ``name``, keyed; with
    ``copies``, each request once per copy, in arrival order."""
    if tokens_per_block % chunk_tokens:
        raise ConfigError(f"chunk_tokens {chunk_tokens} must divide tokens_per_block {tokens_per_block}")
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with open(trace_path(name, data)) as f:
        for line in f:
            row = json.loads(line)
            t_s = row["timestamp"] / 1000
            if (limit is not None and len(rows) >= limit) or (span_s is not None and t_s >= span_s):
                break
            rows.append((t_s, row["input_length"], row["output_length"], tuple(row["hash_ids"])))
    memo: dict[tuple[tuple[int, ...], int], list[bytes]] = {}
    out = []
    for copy in range(copies):
        for t_s, n_in, n_out, ids in rows:
            keys = memo.get((ids, copy))
            if keys is None:
                keys = memo[(ids, copy)] = request_keys(ids, tokens_per_block, chunk_tokens, copy)
            out.append(Request(t_s, n_in, n_out, ids, keys, copy))
    out.sort(key=lambda r: (r.t_s, r.copy))
    return out


def ceiling(requests: list[Request]) -> float:
    """The hit rate of an infinite cache over the requests' chunks (prefix rule: the leading chunks seen before)."""
    return prefix_hit_rate(r.keys for r in requests)


def prefix_hit_rate(sequences: Iterable[Sequence[Hashable]]) -> float:
    """The share of the items of ``sequences`` (in order) that lie in a prefix whose every item came earlier."""
    seen: set[Hashable] = set()
    hits = total = 0
    for items in sequences:
        prefix = True
        for item in items:
            prefix = prefix and item in seen
            hits += prefix
            seen.add(item)
        total += len(items)
    return hits / total if total else 0.0
