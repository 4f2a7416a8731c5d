"""Routing over vLLM engines: each engine's own prefix cache, known from its KV events, beside the pool's contents.

A vLLM engine keeps the KV of recent prompts in its own (GPU) blocks, and serves a prompt whose prefix it holds
without reading anything; the pool serves the rest of what it holds at the cost of a read, nearest replica first.
The :class:`EngineRouter` quotes each engine's time to first token from both: the prefix the engine holds itself
(a :class:`BlockIndex` fed by the engine's KV events), the pool's chunks past it by read path (the watch cache, as
:class:`~kvpool.prefill_decode.routing.router.LaneRouter` does for our workers), and the engine's queue.

The events are vLLM's own (``--kv-events-config``): an engine given a non-wildcard endpoint *connects* its PUB
socket there, so the router binds one SUB socket (:class:`EngineEvents`) and every engine publishes to it under its
own topic.  ``BlockStored`` carries each block's tokens and its parent's hash, so the router indexes blocks by
``(parent, tokens, extra keys)`` and never needs vLLM's hash function; a prompt's cached prefix is a walk down
that index, ``block_size`` tokens at a time.
"""

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec
import zmq

from kvpool.core.config import checked
from kvpool.core.types import Placement
from kvpool.errors import ConfigError
from kvpool.metadata.zmq_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.routing.cost import CostModel
from kvpool.prefill_decode.routing.router import LaneRouter, Policy, Quote, by_path, decide, prefix_sources

log = logging.getLogger(__name__)

DEVICE_MEDIA = (None, "GPU")  #: the media of an engine's own blocks (vLLM's CPU platform calls them GPU as well)

_Hash = bytes | int
_Key = tuple[_Hash | None, tuple[int, ...], tuple[Any, ...] | None]


class BlockIndex:
    """One engine's prefix cache as its KV events describe it.

    Blocks are indexed by ``(parent hash, tokens, extra keys)``: the extra keys are what vLLM hashes beside the
    tokens (the ``cache_salt`` on a prompt's first block, LoRA, multimodal inputs), so a salted prompt never matches
    an unsalted one, as in vLLM itself.
    """

    def __init__(self) -> None:
        self.block_size = 0  #: from the first BlockStored (0: nothing seen yet)
        self._child: dict[_Key, _Hash] = {}
        self._key: dict[_Hash, _Key] = {}

    def __len__(self) -> int:
        return len(self._key)

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if isinstance(event, AllBlocksCleared):
            self._child.clear()
            self._key.clear()
        elif event.medium not in DEVICE_MEDIA:
            return  # a copy in an offloading tier of the engine's: not a prefix it serves without reading
        elif isinstance(event, BlockStored):
            size, parent = event.block_size, event.parent_block_hash
            if size < 1 or len(event.token_ids) != size * len(event.block_hashes):
                log.warning(
                    "engine event: %d tokens for %d blocks of %d; skipped",
                    len(event.token_ids),
                    len(event.block_hashes),
                    size,
                )
                return
            self.block_size = size
            extras = event.extra_keys or [None] * len(event.block_hashes)
            for i, block in enumerate(event.block_hashes):
                extra = extras[i] if i < len(extras) else None
                key = (parent, tuple(event.token_ids[i * size : (i + 1) * size]), tuple(extra) if extra else None)
                self._child[key] = block
                self._key[block] = key
                parent = block
        else:
            for block in event.block_hashes:
                if block in self._key:
                    key = self._key.pop(block)
                    if self._child.get(key) == block:
                        del self._child[key]

    def cached_tokens(self, tokens: Sequence[int], salt: str = "") -> int:
        """Leading tokens of ``tokens`` (sent with ``cache_salt`` ``salt``) the engine holds, whole blocks only."""
        size = self.block_size
        if size < 1:
            return 0
        parent: _Hash | None = None
        held = 0
        while held + size <= len(tokens):
            extra = (salt,) if salt and held == 0 else None
            block = self._child.get((parent, tuple(tokens[held : held + size]), extra))
            if block is None:
                break
            parent, held = block, held + size
        return held


_Topics = Annotated[
    Sequence[Annotated[str, msgspec.Meta(min_length=1, description="a topic: a non-empty string")]],
    msgspec.Meta(min_length=1, description="a list of topics, one per engine"),
]


class EngineEvents:
    """A SUB socket bound at ``endpoint`` (``tcp://HOST:*``: a free port, then :attr:`endpoint` says which) that vLLM
    engines publish their KV events to, one :class:`BlockIndex` per engine, told apart by topic.  A gap in an engine's sequence numbers (events dropped at a high-water mark)
    clears its index: the router then under-predicts that engine's hits until the engine stores again, rather
    than sending requests to blocks it may have freed."""

    @checked
    def __init__(self, endpoint: str, topics: _Topics) -> None:
        if len(set(topics)) != len(topics):
            raise ConfigError(f"engine topics must be distinct, got {list(topics)!r:.120}")
        self.indexes = {t: BlockIndex() for t in topics}
        self.events = 0  #: applied, in all
        self.gaps = 0  #: sequence gaps seen (each cleared an index)
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        try:
            self._sub.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(0)
            self._ctx.term()
            raise ConfigError(
                f"cannot bind the engines' KV event endpoint {endpoint}: {exc}; pick a free port"
            ) from None
        self.endpoint: str = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)  #: with the port ``:*`` chose
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-engine-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sub.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return  # closed
            if len(frames) != 3:
                continue
            topic = bytes(frames[0]).decode(errors="replace")
            try:
                batch = self._decoder.decode(frames[2])
            except msgspec.DecodeError as exc:
                log.warning("engine %s: undecodable KV event batch (%s); skipped", topic, exc)
                continue
            self.apply(topic, int.from_bytes(frames[1], "big", signed=True), batch)

    def apply(self, topic: str, seq: int, batch: KVEventBatch) -> None:
        with self._lock:
            index = self.indexes.get(topic)
            if index is None:
                return  # an engine this router does not route to
            last = self._seq.get(topic)
            if last is not None and seq != last + 1:
                log.warning(
                    "engine %s: KV events %d..%d missed; its prefix cache is taken as empty", topic, last + 1, seq - 1
                )
                self.gaps += 1
                index.apply(AllBlocksCleared())
            self._seq[topic] = seq
            for event in batch.events:
                index.apply(event)
            self.events += len(batch.events)

    def cached_tokens(self, topic: str, tokens: Sequence[int], salt: str = "") -> int:
        with self._lock:
            return self.indexes[topic].cached_tokens(tokens, salt)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(0)
        self._ctx.term()


class EngineRouter(LaneRouter):
    """A :class:`LaneRouter` whose lanes are vLLM engines with the kvpool connector.

    ``local(lane, tokens, scope)`` is the prefix engine ``lane`` holds itself (:meth:`EngineEvents.cached_tokens`);
    the pool's chunks past it are priced by read path from the engine's node, and the engine's queue is added as for
    our workers.  A prompt queued on an engine counts as in that engine's own cache by the time the next one runs
    (vLLM keeps it there), not as pool DRAM.  ``keys`` names the chunk objects of every layer (the engines'
    identity); vLLM loads whatever the pool holds past its own prefix, so that is what is priced.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        costs: Sequence[CostModel],
        keys: Callable[[Sequence[int], Scope | None], list[list[bytes]]],
        chunk_size: int,
        replicas: Callable[[bytes], Sequence[Placement]],
        local: Callable[[int, Sequence[int], Scope | None], int],
        policy: "Policy | str" = Policy.CACHE_AWARE,
    ) -> None:
        super().__init__(nodes, costs, keys, chunk_size, replicas, policy)
        self.local = local

    def quote(
        self,
        lane: int,
        tokens: Sequence[int],
        scope: Scope | None,
        keys: list[list[bytes]],
        cached: int,
        flat: tuple[bytes, ...],
    ) -> Quote:
        node, cost, n = self.nodes[lane], self.costs[lane], len(tokens)
        queued_here = self._pending[lane]
        ahead = 0  # chunks a request queued on this engine shares with this one: in its cache by then
        while ahead < len(keys) and all(queued_here[k] for k in keys[ahead]):
            ahead += 1
        local = max(self.local(lane, tokens, scope), ahead * self.chunk_size)
        first = min(local // self.chunk_size, cached)  # the pool's chunks from here on are read, not held
        paths = by_path(prefix_sources(self.replicas, keys[first:], cached - first, node), node)
        pool_tokens = min(cached * self.chunk_size, n) if paths else 0
        decision = decide(cost, n, pool_tokens, paths, local_tokens=local)
        return Quote(lane, decision, self._queued[lane], self._queued_s[lane], flat)
