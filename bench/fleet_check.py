"""The simulator checked against a real pool: the first requests of a trace, scaled down (few tokens a block, chunks
of one page), replayed through a real pool with real puts and gets of synthetic bytes, and through the simulated
fleet on the same configuration.  Both serve each request alike: a prefix lookup, a read of the chunks found (each
from its nearest replica), a put of the rest on the request's node, chosen round-robin over the nodes.
``tests/integration/pool/test_fleet_replay.py`` runs it on three Ray nodes.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.bench.fleet_sim import FleetSettings, replay
from kvpool.bench.workloads.mooncake import Request, load
from kvpool.pool.client import PoolClient

TOKENS_PER_BLOCK = 16  #: a trace block scaled down: one chunk of 16 tokens
TOKEN_BYTES = 256  #: so a chunk is one 4 KiB page


@dataclass(frozen=True)
class Check:
    """The scaled-down configuration both replays run."""

    nodes: int = 3
    dram_bytes: int = 8 << 20  #: per node: 2,048 chunks
    requests: int = 600
    alignment: int = 4096

    @property
    def chunk_bytes(self) -> int:
        return TOKENS_PER_BLOCK * TOKEN_BYTES

    def settings(self) -> FleetSettings:
        return FleetSettings(
            nodes=self.nodes,
            dram_tokens=self.dram_bytes // TOKEN_BYTES,
            policy="round-robin",
            chunk_tokens=TOKENS_PER_BLOCK,
            token_bytes=TOKEN_BYTES,
            alignment=self.alignment,
        )

    def trace(self, name: str) -> list[Request]:
        return load(name, limit=self.requests, tokens_per_block=TOKENS_PER_BLOCK, chunk_tokens=TOKENS_PER_BLOCK)


def simulated(check: Check, requests: Sequence[Request]) -> float:
    """The simulator's hit rate (chunks reused / chunks asked) on the check's configuration."""
    return replay(requests, check.settings()).hit_rate


def real(check: Check, client: PoolClient, node_ids: Sequence[str], requests: Sequence[Request]) -> tuple[float, int]:
    """The real pool's hit rate, and how many chunks it read back with other bytes than were put: per request a
    lookup, a ``get_batch`` of the prefix found, and a ``put_batch`` of the rest on ``node_ids[i % nodes]``."""
    hits = total = wrong = 0
    for i, req in enumerate(requests):
        held = client.lookup_prefix(req.keys)
        if held:
            got = client.get_batch(req.keys[:held])
            wrong += sum(g != _data(k, check.chunk_bytes) for g, k in zip(got, req.keys, strict=False))
        rest = [(k, _data(k, check.chunk_bytes)) for k in req.keys[held:]]
        if rest:
            client.put_batch(rest, nodes=[node_ids[i % check.nodes]])
        hits += held
        total += len(req.keys)
    return (hits / total if total else 0.0), wrong


def _data(key: bytes, size: int) -> bytes:
    """A chunk's synthetic KV bytes: its key repeated."""
    return (key * (size // len(key) + 1))[:size]
