"""Chunk events in the shape outside routers already consume: vLLM's KV events, msgpack over ZeroMQ.

vLLM's engines publish ``KVEventBatch`` es of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` on a PUB
socket as three frames (topic, an 8-byte big-endian sequence number, the msgpack payload) and serve a ROUTER
socket from which a subscriber that saw a gap in the sequence asks for the batches from a sequence number on.
Routers built for that stream (llm-d's KV-cache indexer, Dynamo's KV router, vLLM's own examples) can subscribe to
kvpool the same way.  The structs here have the names, fields, tags and encoding of vLLM's
(``vllm/distributed/kv_events.py``), written without importing vLLM; the tests decode what this module sends with
vLLM's own classes.

How a chunk event maps onto them: the chunk key (32 bytes) is the block hash; ``medium`` is the tier
(``CPU`` for DRAM, ``DISK`` for NVMe, ``STORAGE`` for the remote tier); ``ownership`` is the holder's node id;
a move is a ``BlockRemoved`` from the old medium and a ``BlockStored`` in the new.  A ``BlockStored`` of a chunk put
under a known cache identity carries its fingerprint in ``extra_keys``, one ``(fingerprint,)`` per block hash: vLLM
defines that field as the extra inputs of a block's hash (it puts a request's cache salt there), and the identity is
exactly that, the root of the chunk's hash chain.  The other free fields mean something else to routers
(``lora_name`` picks an adapter, ``kv_cache_spec_kind`` an attention kind, ``session_id`` a request), and a
``BlockRemoved`` needs none: its hash already names one identity's chunk.  A placement does not record
the chunk's tokens, so ``token_ids`` is empty, ``block_size`` 0 and ``parent_block_hash`` None: match blocks by
hash, computed with :func:`kvpool.core.keys.chunk_keys` over the same cache identity.  A stream that starts from
the pool's contents opens with ``AllBlocksCleared``.  One batch per etcd revision that changed chunks.
"""

import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.metadata.events import ChunkEvent, EventKind

log = logging.getLogger(__name__)

MEDIUM = {Tier.DRAM: "CPU", Tier.NVME: "DISK", Tier.REMOTE: "STORAGE"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)  #: the replay socket's last frame of an answer
REPLAY_BATCHES = 10_000  #: batches kept for subscribers that ask for what they missed


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def _stored(e: ChunkEvent) -> BlockStored:
    medium = MEDIUM[e.tier] if e.tier else None
    extra: list[tuple[Any, ...] | None] | None = [(e.identity,)] if e.identity else None
    return BlockStored([e.key], None, [], 0, None, medium, None, extra, ownership=e.node)


def _removed(e: ChunkEvent, tier: Tier | None) -> BlockRemoved:
    return BlockRemoved([e.key], MEDIUM[tier] if tier else None, ownership=e.node)


def vllm_batch(events: list[ChunkEvent], *, cleared: bool = False) -> KVEventBatch:
    """One ``KVEventBatch`` of ``events`` (``cleared``: it opens with ``AllBlocksCleared``, for a stream that
    starts from the pool's contents)."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()] if cleared else []
    for e in events:
        if e.kind is EventKind.STORED:
            out.append(_stored(e))
        elif e.kind is EventKind.REMOVED:
            out.append(_removed(e, e.tier))
        else:
            out += [_removed(e, e.was), _stored(e)]
    return KVEventBatch(time.time(), out)


class ZmqPublisher:
    """A PUB socket bound at ``endpoint`` sending ``(topic, seq, payload)`` per batch, and, at ``replay_endpoint``,
    a ROUTER socket that answers a request carrying an 8-byte start sequence number with every kept batch from
    there on, then ``END_SEQ``.  Sequence numbers count batches from 0, with no gaps, as vLLM's do."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "kvpool") -> None:
        self._stop = threading.Event()
        self._replayer: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(
                f"cannot bind the event sockets ({endpoint}, {replay_endpoint or 'no replay'}): {exc}; "
                "give free tcp://HOST:PORT endpoints"
            ) from None
        self.topic = topic.encode()
        self._seq = 0
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  #: ZeroMQ sockets are not thread-safe: one sender at a time
        if self._replay is not None:
            self._replayer = threading.Thread(target=self._serve_replay, name="kvpool-events-replay", daemon=True)
            self._replayer.start()

    def publish(self, batch: KVEventBatch) -> int:
        """Send ``batch``; its sequence number."""
        payload = self._encoder.encode(batch)
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._kept.append((seq, payload))
        return seq

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while not self._stop.is_set():
            if not self._replay.poll(100):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("malformed replay request (%d frames): ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                kept = [(s, p) for s, p in self._kept if s >= first]
            for seq, payload in kept:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._replayer is not None:
            self._replayer.join()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
