"""A client's reads from the S3 (remote) tier: a chunk whose only copies are there is fetched by the client
itself (several GETs at once), verified, opened (an encrypted tier's objects, with ``remote.encryption``'s keys),
decoded and, with ``remote.promote_on_hit``, put back into the pool.  An object this client cannot open (no key, another
key, altered) is a miss; its placement and object are kept, since other processes may hold the right key.  Also
the removal of S3 copies and the reconciliation of the bucket with etcd (``kvpool gc``)."""

import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.core.types import Placement
from kvpool.errors import ChunkNotFound, ConfigError, KvPoolError, MetadataUnavailable, RemoteUnavailable, SetupError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.placement import PlacementStore
from kvpool.pool.chunks import checksum, short
from kvpool.pool.client.reads import Outcome, fill
from kvpool.pool.tiers.codecs import Buffer, TensorFormat
from kvpool.pool.tiers.crypto import Keyring, UndecryptableChunk, split, unseal
from kvpool.pool.tiers.s3 import RemoteStore, collect_garbage
from kvpool.pool.tiers.s3_config import RemoteConfig

log = logging.getLogger(__name__)

S3_THREADS = 8  #: concurrent GETs from the remote tier in one batch


class RemoteReads:
    """``put_back`` puts promoted chunks into the pool (the client's ``put_batch``), each batch with the cache
    identity their S3 placements recorded."""

    def __init__(
        self,
        config: RemoteConfig,
        cluster: str,
        cache: MetadataCache,
        placements: PlacementStore,
        put_back: Callable[..., None],
        wait_s: float,
    ) -> None:
        self.config, self.cluster = config, cluster
        self.cache, self.placements, self.put_back, self.wait_s = cache, placements, put_back, wait_s
        self._store: RemoteStore | None = None  #: made on first use
        self._keys: Keyring | None = None  #: loaded on first use of a sealed object

    def store(self) -> RemoteStore | None:
        if self._store is None and self.config.enabled:
            self._store = RemoteStore(self.config, self.cluster)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    def read(self, replicas: list[Placement], dests: list[memoryview]) -> list[Outcome]:
        """Fetch chunks (concurrently), verify and decode them into ``dests``; an :data:`Outcome` per chunk (None:
        the object is gone — its placement is dropped — or the tier is unavailable or not configured here)."""
        s3 = self.store()
        if s3 is None:
            log.warning("%d chunks are only in the remote tier, which this client has no config for", len(replicas))
            return [None] * len(replicas)
        with ThreadPoolExecutor(S3_THREADS, thread_name_prefix="kvpool-s3") as pool:
            fetches = [pool.submit(s3.get, p.key, p.codec) for p in replicas]
        out: list[Outcome] = []
        gone: list[Placement] = []
        promote: dict[str, list[tuple[bytes, Any]]] = {}  #: by the cache identity the chunks were written under
        for p, dest, fetch in zip(replicas, dests, fetches, strict=True):
            try:
                data = fetch.result()
            except ChunkNotFound:
                gone.append(p)
                out.append(None)
                continue
            except RemoteUnavailable as exc:
                log.warning("chunk %s: remote tier unavailable, a miss: %s", short(p.key), exc)
                out.append(None)
                continue
            intact, body, codec = self._fill(p, dest, data)  # body, codec: below the seal, if any
            out.append(intact)
            if out[-1] and self.config.promote_on_hit:
                fmt = TensorFormat.of_encoded(body) if codec != "raw" else None
                promote.setdefault(p.identity, []).append((p.key, fmt.view(dest) if fmt is not None else dest))
        if gone:
            log.warning("%d S3 placements named objects that are gone: dropping them", len(gone))
            with contextlib.suppress(MetadataUnavailable):  # a read does not fail for etcd; the next reader drops them
                self.drop(gone, delete_objects=False)
        if promote and self.cache.nodes():
            try:
                for identity, items in promote.items():
                    self.put_back(items, identity=identity)
            except KvPoolError as exc:  # the read succeeded; only the promotion did not
                log.info("could not promote %d chunks from the remote tier: %s", sum(map(len, promote.values())), exc)
        return out

    def _fill(self, p: Placement, dest: memoryview, data: bytes) -> tuple[Outcome, Buffer, str]:
        """``fill`` for an object, opened first if sealed: whether it came out intact (None: this client cannot open
        it), and its bytes and codec below the seal."""
        if not split(p.codec)[1]:
            return fill([dest], data, p.codec, p.checksum), data, p.codec
        if checksum(data) != p.checksum:
            return False, data, p.codec
        try:
            if self._keys is None:
                self._keys = self.config.encryption.keyring()
            plain, codec = unseal(data, p.codec, p.key, self._keys)
        except (UndecryptableChunk, ConfigError, SetupError) as exc:  # this process cannot load the keys
            log.warning("chunk %s in the remote tier cannot be opened here, a miss: %s", short(p.key), exc)
            return None, data, p.codec
        return fill([dest], plain, codec, checksum(plain)), plain, codec

    def drop(self, replicas: Sequence[Placement], *, delete_objects: bool = True) -> None:
        """Delete S3 copies: their objects, then their placements (a placement left behind by a failure names a
        missing object, which the next reader drops; an object left behind is :meth:`gc`'s)."""
        if delete_objects and (s3 := self.store()) is not None:
            s3.delete([(p.key, p.codec) for p in replicas])
        revision = self.placements.delete(replicas)
        self.cache.wait_until(lambda c: c.revision >= revision, timeout_s=self.wait_s)

    def gc(self, grace_s: float) -> tuple[int, int]:
        """Reconcile the bucket with etcd (see :func:`~kvpool.pool.tiers.s3.collect_garbage`)."""
        s3 = self.store() or RemoteStore(self.config, self.cluster)  # the tier off: ConfigError saying so
        return collect_garbage(s3, self.cache, self.placements, grace_s)
