"""The node's flush to the remote tier: which NVMe chunks go up, how they are encoded, and the back-off after a refused
upload.  A plain class on an injected clock; the ``PoolNode`` runs a turn and publishes what it returns."""

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.core.types import Placement, Tier
from kvpool.errors import RemoteUnavailable
from kvpool.pool.chunks import Recoded, StoredChunk
from kvpool.pool.node.moves import read_stored, recode
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.tiers.crypto import sealed_name
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig

log = logging.getLogger(__name__)

FLUSH_BYTES = 64 << 20  #: one flush turn uploads at most this much
FLUSH_THREADS = 4  #: concurrent uploads in a flush turn
MIN_PAUSE_S, MAX_PAUSE_S = 1.0, 60.0  #: back-off after a turn the S3 endpoint refused: doubled each time


def idle(store: ChunkStore, tier: Tier, idle_s: float, max_bytes: int) -> list[StoredChunk]:
    """Unpinned chunks of ``tier`` with no remote copy, not read for ``idle_s`` seconds, least recently used first,
    at most ``max_bytes`` of them (at least one, if there is one)."""
    now, total = store.clock.time(), 0
    out: list[StoredChunk] = []
    for key in store.policy.lru(tier):
        chunk = store.held(key)
        if chunk is None or now - store.policy.state(key).last_access < idle_s:
            break
        if chunk.in_remote:
            continue
        if out and total + chunk.stored > max_bytes:
            break
        out.append(chunk)
        total += chunk.stored
    return out


class Flusher:
    """Uploads NVMe chunks idle for ``config.flush_after_s`` (least recently used first) to the remote tier, encoded
    with ``config.codec`` (and sealed, with ``config.encryption`` set: every chunk, bytes or tensor).  A turn with a failed upload pauses the next ones (1 s, doubling to 60 s); the chunks
    it could not upload stay on NVMe, unflushed, for a later turn."""

    def __init__(
        self, remote: RemoteStore, config: RemoteConfig, store: ChunkStore, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.remote, self.config, self.store, self.clock = remote, config, store, clock
        self.keys = config.encryption.keyring()  #: seals what goes up (None: the tier is not encrypted)
        self.codec = config.codec if self.keys is None else sealed_name(config.codec)  #: objects' codec
        self.pause_s = 0.0  #: the current back-off (0: the last turn went through)
        self.not_before = 0.0  #: no turn before this (the clock's monotonic seconds)

    def due(self) -> bool:
        return self.clock.monotonic() >= self.not_before

    def turn(self, lock: AbstractContextManager[object], max_bytes: int = FLUSH_BYTES) -> list[Placement]:
        """Upload what is idle (at most ``max_bytes``); the S3 placements of what went up, to publish.  The chunks
        are pinned (under ``lock``, the store's) while they are read, encoded and uploaded (without it)."""
        with lock:
            chunks = [self.store.pin(c.key) for c in idle(self.store, Tier.NVME, self.config.flush_after_s, max_bytes)]
        encoded: list[Recoded | None] = []
        try:
            with ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix="kvpool-flush") as pool:
                encoded = list(pool.map(self._encoded, chunks))
                uploads = [
                    (c, r, pool.submit(self.remote.put, c.key, r.codec, r.data))
                    for c, r in zip(chunks, encoded, strict=True)
                    if r is not None
                ]
        finally:
            with lock:
                for chunk in chunks:
                    self.store.release(chunk.key)
                for chunk, recoded in zip(chunks, encoded, strict=False):  # none if the reads failed
                    if recoded is None:
                        self.store.drop_corrupt(chunk)
        placements: list[Placement] = []
        error: RemoteUnavailable | None = None
        for chunk, recoded, upload in uploads:
            try:
                upload.result()
            except RemoteUnavailable as exc:
                error = exc
                continue
            placements.append(
                Placement(
                    key=chunk.key,
                    node=self.config.name,
                    tier=Tier.REMOTE,
                    offset=0,
                    stored=len(recoded.data),
                    size=chunk.size,
                    checksum=recoded.checksum,
                    codec=recoded.codec,
                    identity=chunk.origin.identity,
                )
            )
        self.pause_s = 0.0 if error is None else min(max(2 * self.pause_s, MIN_PAUSE_S), MAX_PAUSE_S)
        self.not_before = self.clock.monotonic() + self.pause_s
        if error is not None:
            self.store.counters["remote_errors"] += 1
            log.warning(
                "flush to the remote tier: %d of %d chunks not uploaded: %s",
                len(uploads) - len(placements),
                len(uploads),
                error,
            )
        return placements

    def _encoded(self, chunk: StoredChunk) -> Recoded | None:
        """A pinned chunk's bytes under the remote codec (None: they failed their checksum)."""
        stored = read_stored(self.store.segments[chunk.tier], chunk.offset, chunk.stored)
        return recode(chunk, stored, self.codec, self.keys, self.store.keyring)
