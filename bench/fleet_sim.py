"""A fleet of simulated pool nodes serving a request trace: kvpool's own store, eviction, watermarks, write path,
replica order and routing policies, with time and bytes from stated hardware figures (no KV byte is allocated).

Each request, at its arrival on the trace's clock (a :class:`~kvpool.clock.ManualClock` every node's store reads):

1. **lookup**: the leading chunks the pool holds — in the placements every node's changes published (the watch cache's
   view: a chunk is held while some node or the S3 tier has it), or, for ``local`` caches, on each node alone;
2. **route**: a quote per node from the cost model (:func:`~kvpool.prefill_decode.routing.router.decide`: the cached
   prefix's bytes by the path a read takes from that node, priced per path) and its queue of booked prefills;
   :func:`~kvpool.prefill_decode.routing.router.choose` picks by policy (cache-aware, least-loaded, round-robin);
3. **read** the cached prefix (each chunk from its nearest replica, :func:`~kvpool.core.types.nearest`) and **put**
   the rest on the chosen node by the client's write path; the node's prefill is booked for the quote's seconds.

A request's chunks are in the pool from its arrival on (its prefill is not waited for): the trace's hit rates are
those of the cache, as the paper counts them.  With an S3 tier, a turn every ``flush_every_s`` flushes each node's
NVMe chunks idle for ``flush_after_s`` (``pool/node/flush.py``'s choice) to an unbounded S3 tier.
"""

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.bench.fleet_node import Queues, SimNode, put, read
from kvpool.bench.workloads.mooncake import BLOCK_TOKENS, Request
from kvpool.clock import ManualClock
from kvpool.core.types import Placement, Tier, nearest
from kvpool.metadata.lookup import AccessRecorder
from kvpool.pool.chunks import ChangeKind, StoredChunk
from kvpool.pool.client.writes import Rooms
from kvpool.pool.config import Watermarks
from kvpool.pool.node.flush import idle
from kvpool.prefill_decode.routing.cost import REFERENCE_HARDWARE, Action, CostModel, Decision, model_spec
from kvpool.prefill_decode.routing.router import Policy, Quote, choose, decide, read_path

MODEL = model_spec("llama-3-70b")  #: 80 layers, 8 KV heads of 128, bf16: 327,680 bytes (320 KiB) of KV a token
NIC_BYTES_S = 4 * 200e9 / 8  #: a node's 4 x 200 Gbps NIC: 100 GB/s
#: the design's reference analysis (400 TFLOPS effective prefill; DRAM 64, NVMe 14, S3 2 GB/s), a peer's DRAM read at
#: the lesser of the NIC and the DRAM (PCIe) figure: stated figures, not measured here
HARDWARE = REFERENCE_HARDWARE.with_overrides(peer=min(NIC_BYTES_S, REFERENCE_HARDWARE.bandwidth["dram"]))
S3 = "s3"  #: the node name of the S3 tier's placements


@dataclass(frozen=True)
class FleetSettings:
    nodes: int = 16
    dram_tokens: int = 3_000_000  #: per node
    nvme_tokens: int = 0  #: per node (0: no NVMe tier)
    s3: bool = False  #: an S3 tier below NVMe (needs one)
    shared: bool = True  #: kvpool's global pool; False: each node's cache its own (the paper's local caches)
    policy: str = "cache-aware"
    chunk_tokens: int = BLOCK_TOKENS
    token_bytes: int = MODEL.kv_bytes_per_token
    alignment: int = 4096
    watermarks: Watermarks = field(default_factory=Watermarks)
    flush_after_s: float = 300.0
    flush_every_s: float = 10.0

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.token_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.nodes * (self.dram_tokens + self.nvme_tokens)


@dataclass
class FleetResult:
    settings: FleetSettings
    requests: int = 0
    chunks: int = 0
    hits: int = 0
    prefill_s: float = 0.0  #: what the chosen quotes priced: reload + the rest, or recompute
    recompute_s: float = 0.0  #: every prompt recomputed whole
    first_s: float = math.inf
    last_s: float = 0.0
    hits_by_path: Counter[str] = field(default_factory=Counter)  #: chunks read, by path (dram, peer, nvme, remote)
    links: Counter[str] = field(default_factory=Counter)  #: bytes moved, by link kind
    peer_out: Counter[str] = field(default_factory=Counter)  #: bytes each node served to peers
    published: Counter[str] = field(default_factory=Counter)  #: placement changes published, by kind
    counters: Counter[str] = field(default_factory=Counter)  #: the nodes' store counters, summed
    held_chunks: int = 0  #: chunks the pool holds at the end (replicas counted once per holder)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.chunks if self.chunks else 0.0

    @property
    def saved(self) -> float:
        """Fraction of the prefill GPU time the pool saved."""
        return 1 - self.prefill_s / self.recompute_s if self.recompute_s else 0.0

    @property
    def span_s(self) -> float:
        return max(self.last_s - self.first_s, 1e-9)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "chunks": self.chunks,
            "hit_rate": self.hit_rate,
            "prefill_saved": self.saved,
            "span_s": self.span_s,
            "hits_by_path": dict(self.hits_by_path),
            "links_bytes": dict(self.links),
            "peer_out_max_bytes": max(self.peer_out.values(), default=0),
            "published": dict(self.published),
            "counters": dict(self.counters),
            "held_chunks": self.held_chunks,
        }


class Fleet:
    """``settings.nodes`` simulated nodes and the placements they published; :meth:`serve` one request at a time.
    ``logs``: an access log per node (``kvpool advise``'s input), each lookup recorded on the chosen node's."""

    def __init__(self, settings: FleetSettings, logs: Sequence[AccessRecorder] = ()) -> None:
        s = self.s = settings
        self.clock = ManualClock(0.0)
        self.nodes = [
            SimNode(
                f"node-{i:04d}",
                s.dram_tokens * s.token_bytes,
                s.nvme_tokens * s.token_bytes,
                self.clock,
                watermarks=s.watermarks,
                alignment=s.alignment,
            )
            for i in range(s.nodes)
        ]
        self.by_id = {n.node_id: n for n in self.nodes}
        self.lane = {n.node_id: i for i, n in enumerate(self.nodes)}
        self.rooms = Rooms()
        self.index: dict[bytes, dict[str, Placement]] = {}  #: the placements published: the watch cache's view
        self.cost = CostModel(MODEL, HARDWARE)
        self.policy = Policy.of(s.policy)
        self.logs = list(logs)
        self.turn = 0
        self.queues = Queues(s.nodes)
        self.next_flush = s.flush_every_s
        self.result = FleetResult(s)

    # -- one request ------------------------------------------------------------------------------------

    def serve(self, req: Request) -> Quote:
        r, now = self.result, req.t_s
        self.clock.advance(max(0.0, now - self.clock.time()))
        if self.s.s3 and now >= self.next_flush:
            self._flush()
        self.queues.advance(now)
        quotes, sources, held = self._quotes(req) if self.s.shared else self._local_quotes(req)
        quote = choose(self.policy, quotes, self.turn)
        self.turn += 1
        node = self.nodes[quote.lane]
        cached = held[quote.lane] if quote.decision.action is Action.RELOAD else 0
        if self.logs:
            self.logs[quote.lane].record(req.keys, self._size_of)
        touched = self._read(node, req.keys[:cached], sources)
        put(self.rooms, node, req.keys[cached:], self.s.chunk_bytes)
        r.links["put (same node)"] += (len(req.keys) - cached) * self.s.chunk_bytes
        self._publish([node, *touched])
        self.queues.book(quote.lane, now, quote.prefill_s)
        r.requests += 1
        r.chunks += len(req.keys)
        r.hits += cached
        r.prefill_s += quote.prefill_s
        r.recompute_s += quote.decision.recompute_s
        r.first_s, r.last_s = min(r.first_s, now), max(r.last_s, now)
        return quote

    def _size_of(self, key: bytes) -> int:
        return self.s.chunk_bytes if key in self.index else 0

    def _tokens(self, req: Request) -> int:
        return max(req.input_tokens, 1)

    def _lanes(self, holders: Iterable[int]) -> list[int]:
        """The nodes to quote: all of them for round-robin; else those with prefills booked or some of the prompt
        held, and the first other node from this turn's on — the others are that one's equals (no queue, nothing
        held), so they could win only a tie, which this one stands for."""
        n = len(self.nodes)
        if self.policy is Policy.ROUND_ROBIN:
            return list(range(n))
        lanes = self.queues.active | set(holders)
        for step in range(n):
            if (lane := (self.turn + step) % n) not in lanes:
                lanes.add(lane)
                break
        return sorted(lanes)

    def _decision(self, req: Request, chunks: int, paths: Counter[str]) -> Decision:
        n = self._tokens(req)
        cached = min(chunks * self.s.chunk_tokens, n) if chunks else 0
        return decide(self.cost, n, cached, {p: b for p, b in paths.items() if b})

    def _quotes(self, req: Request) -> tuple[list[Quote], list[list[Placement]], list[int]]:
        """The global pool: every node sees the same prefix; a node that holds some of it reads those chunks itself."""
        held = 0
        for key in req.keys:
            if key not in self.index:
                break
            held += 1
        sources = [list(self.index[k].values()) for k in req.keys[:held]]
        base: Counter[str] = Counter()
        own: dict[str, Counter[str]] = {}
        for reps in sources:
            far = nearest(reps, "")  # a node that holds none of it
            assert far is not None
            path = read_path(far.tier.value, far.node, "")
            base[path] += self.s.chunk_bytes
            for p in reps:
                if p.node != S3:
                    delta = own.setdefault(p.node, Counter())
                    mine = nearest(reps, p.node)
                    assert mine is not None
                    delta[path] -= self.s.chunk_bytes
                    delta[read_path(mine.tier.value, mine.node, p.node)] += self.s.chunk_bytes
        shared = self._decision(req, held, base)
        special = {self.lane[nid]: self._decision(req, held, base + d) for nid, d in own.items()}
        quotes = [Quote(i, special.get(i, shared), *self.queues.of(i, req.t_s)) for i in self._lanes(special)]
        return quotes, sources, [held] * len(self.nodes)

    def _local_quotes(self, req: Request) -> tuple[list[Quote], list[list[Placement]], list[int]]:
        """Local caches: each node sees its own chunks only (the prefix-aware scheduler's view)."""
        none = self._decision(req, 0, Counter())
        first = req.keys[0] if req.keys else b""
        lanes = [0] * len(self.nodes)
        decisions = {}
        for i in (i for i, node in enumerate(self.nodes) if first in node.store):
            paths = Counter[str]()
            for key in req.keys:
                chunk = self.nodes[i].store.held(key)
                if chunk is None:
                    break
                lanes[i] += 1
                paths[chunk.tier.value] += self.s.chunk_bytes
            decisions[i] = self._decision(req, lanes[i], paths)
        quotes = [Quote(i, decisions.get(i, none), *self.queues.of(i, req.t_s)) for i in self._lanes(decisions)]
        return quotes, [], lanes

    # -- reads, placements, flushes ---------------------------------------------------------------------

    def _read(self, node: SimNode, keys: list[bytes], sources: list[list[Placement]]) -> list[SimNode]:
        """Read the cached prefix from each chunk's nearest replica, grouped by holder and tier; the holders read."""
        r, size = self.result, self.s.chunk_bytes
        groups: dict[tuple[str, Tier], list[bytes]] = {}
        for j, key in enumerate(keys):
            if sources:
                p = nearest(sources[j], node.node_id)
                assert p is not None
                holder, tier = p.node, p.tier
            else:
                chunk = node.store.held(key)
                assert chunk is not None
                holder, tier = node.node_id, chunk.tier
            path = read_path(tier.value, holder, node.node_id)
            r.hits_by_path[path] += 1
            r.links[_link(tier, holder == node.node_id)] += size
            if path == "peer":
                r.peer_out[holder] += size
            if holder != S3:
                groups.setdefault((holder, tier), []).append(key)
        for (holder, tier), batch in groups.items():
            read(node, self.by_id[holder], batch, tier)
        return [self.by_id[holder] for holder, _ in groups]

    def _publish(self, nodes: Sequence[SimNode]) -> None:
        """The changes of ``nodes`` (those called since the last publish) into the placements (what each node's
        publisher would write to etcd), counted."""
        r, size = self.result, self.s.chunk_bytes
        for node in dict.fromkeys(nodes):
            for change in node.changes():
                key, kind = change.chunk.key, change.kind
                r.published[kind.value] += 1
                if kind is ChangeKind.DROPPED:
                    reps = self.index.get(key)
                    if reps is not None:
                        reps.pop(node.node_id, None)
                        if not reps:
                            del self.index[key]
                    continue
                if kind is ChangeKind.MOVED:
                    r.links["demote DRAM->NVMe" if change.chunk.tier is Tier.NVME else "promote NVMe->DRAM"] += size
                self.index.setdefault(key, {})[node.node_id] = _placement(change.chunk, node.node_id)

    def _flush(self) -> None:
        """Each node's flush turn: NVMe chunks idle for ``flush_after_s`` get a copy in S3 (published, no lease)."""
        r = self.result
        for node in self.nodes:
            if not node.has_nvme:
                continue
            chunks = idle(node.store, Tier.NVME, self.s.flush_after_s, 1 << 62)
            node.store.mark_in_remote([c.key for c in chunks])
            for c in chunks:
                reps = self.index.setdefault(c.key, {})
                if S3 not in reps:
                    reps[S3] = Placement(c.key, S3, Tier.REMOTE, 0, c.stored, c.size, c.checksum)
                    r.published["s3"] += 1
                    r.links["flush NVMe->S3"] += c.stored
        self.next_flush = self.clock.time() + self.s.flush_every_s

    def finish(self) -> FleetResult:
        r = self.result
        for node in self.nodes:
            r.counters.update({k: v for k, v in node.store.counters.items() if v})
        r.held_chunks = sum(len(reps) for reps in self.index.values())
        return r


def _link(tier: Tier, same_node: bool) -> str:
    """The link kind a read takes: same-node DRAM, a peer's DRAM (the network), NVMe (the node's own, or a peer's
    disk then the network), S3."""
    if tier is Tier.REMOTE:
        return "read S3"
    return f"read {'DRAM' if tier is Tier.DRAM else 'NVMe'} ({'same node' if same_node else 'peer'})"


def _placement(chunk: StoredChunk, node_id: str) -> Placement:
    return Placement(chunk.key, node_id, chunk.tier, chunk.offset, chunk.stored, chunk.size, chunk.checksum)


def replay(
    requests: Sequence[Request],
    settings: FleetSettings,
    logs: Sequence[AccessRecorder] = (),
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """Serve ``requests`` in order on a fresh fleet; ``progress(n)`` every 256 requests."""
    fleet = Fleet(settings, logs)
    for i, req in enumerate(requests):
        fleet.serve(req)
        if progress is not None and i % 256 == 255:
            progress(256)
    return fleet.finish()
