"""``KvPoolStorage``: SGLang's HiCache L3 storage backend over the pool.

SGLang loads it with ``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvpool", "module_path":
"kvpool.prefill_decode.sglang.storage", "class_name": "KvPoolStorage", "interface_v1": 1, ...}'`` (``kvpool
sglang-config`` prints the flags for a running pool): the ``dynamic`` factory makes it as ``cls(storage_config,
kwargs)``, then the cache controller registers its host pool (:meth:`KvPoolStorage.register_mem_pool_host`).  From
then on SGLang's own threads call it:

- the **prefetch thread** asks :meth:`~KvPoolStorage.batch_exists` how many leading pages of a prompt the pool holds:
  answered from the pool client's watch-synced copy of etcd (no etcd or Ray round trip);
- the **prefetch I/O thread** loads them into host slots (:meth:`~KvPoolStorage.batch_get_v1`);
- the **backup thread** saves pages the server computed (:meth:`~KvPoolStorage.batch_set_v1`).

Without ``interface_v1`` SGLang's generic path calls ``batch_get``/``batch_set`` with flat data pages instead; both
paths store the same bytes under the same keys (:mod:`~kvpool.prefill_decode.sglang.pages`).  The pool client is used
by one I/O thread of the backend's own (a client is used by one thread); every call waits for its turn there.

Nothing here breaks SGLang's threads: a pool that is down, a node that died, a page that is gone or corrupt is a miss
(``False`` for that page, 0 held) or a failed save, counted with its cause (``kvpool_engine_*``, ``kvpool_misses_total``
on the pool node of this host); no batch call returns ``None`` or raises.  A configuration this backend cannot serve
(a host layout it does not know, context parallelism) raises :class:`~kvpool.errors.ConfigError` when SGLang attaches it.
"""

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvpool.core.keys import CacheIdentity
from kvpool.errors import ConfigError, KvPoolError
from kvpool.metadata.identities import fingerprint
from kvpool.metadata.lookup import PrefixLookup
from kvpool.metadata.misses import MissCause
from kvpool.prefill_decode.connector_core.connection import PoolConnection
from kvpool.prefill_decode.connector_core.counts import EngineCounts
from kvpool.prefill_decode.connector_core.reads import read_each
from kvpool.prefill_decode.connector_core.staging import EngineMemory, HostStaging
from kvpool.prefill_decode.connector_core.tenancy import TenantScope
from kvpool.prefill_decode.sglang.config import StorageConfig
from kvpool.prefill_decode.sglang.pages import PageLayout, page_key

log = logging.getLogger(__name__)
_METRICS = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")  #: StorageMetrics' fields
CONNECT_S = 60.0  #: how long attaching the backend waits for the pool (Ray, etcd, the watch cache)


class KvPoolStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.config = StorageConfig.from_extra(storage_config.extra_config or {})
        _check_parallelism(storage_config)
        tenants = TenantScope.load(self.config.tenants)
        self.scope = tenants.scope(self.config.tenant)  #: the tenant's chain (None: the identity's own)
        self.model = self.config.model_id or storage_config.model_name or ""
        if not self.model:
            raise ConfigError(
                "KvPoolStorage: no model name to key pages by: give model_id in the extra config (or start SGLang "
                "with --served-model-name)"
            )
        self.connection = PoolConnection(self.config)
        self.counts = EngineCounts()  #: reported to this host's pool node from the I/O thread
        self.pages: PageLayout | None = None
        self.identity: CacheIdentity | None = None  #: what pages are keyed under (set when the host pool is known)
        self.root = b""  #: the chain root page keys are made in (set when the host pool is known)
        self.fingerprint = ""  #: the cache identity's, carried by every put
        self._lookup: PrefixLookup | None = None
        #: per batch since SGLang last asked (get_stats): pages and GiB/s of prefetches and backups
        self._batches: dict[str, list[float]] = {k: [] for k in _METRICS}
        self._batches_lock = threading.Lock()
        self._staging = HostStaging()
        #: the host buffer registered with the client's transport (None: not tried yet; False: that failed)
        self._host = EngineMemory()  #: the host buffer, registered with the client's transport (pages land in slots)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvpool-hicache-io")

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool pages move between (MHA or MLA): its layout checked, the cache identity and key root derived
        (with MLA the same on every TP rank, and only the storage-writer rank saves), and the pool connected (on the
        I/O thread, waited for up to ``CONNECT_S``; while it is not, every lookup is 0 pages held and it is tried
        again every ``RETRY_S``)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = PageLayout(mem_pool_host)
        pages.check_pointers(mem_pool_host.get_page_buffer_meta)
        cfg = self.storage_config
        if pages.mla != cfg.is_mla_model:  # the writer rank and the identity's TP both follow from it
            raise ConfigError(
                f"KvPoolStorage: the storage config says is_mla_model={cfg.is_mla_model} but the host pool is "
                f"{type(mem_pool_host).__name__}: attach the backend through SGLang's HiCacheController"
            )
        identity = pages.identity(self.model, cfg.tp_rank, cfg.tp_size, int(getattr(mem_pool_host, "start_layer", 0)))
        self.pages, self.identity, self.fingerprint = pages, identity, fingerprint(identity)
        self.root = identity.root() if self.scope is None else self.scope.root(identity.root())
        try:  # the server starts with the pool's pages visible; a pool that is down does not stop it starting
            self._io.submit(self._client).result(timeout=CONNECT_S)
        except Exception:
            log.warning("kvpool: pool not reachable within %.0f s; pages miss until it is", CONNECT_S)

    # -- keys and lookups --------------------------------------------------------------------------------------

    def keys(self, page_hashes: list[str]) -> list[bytes]:
        """The pool keys of the pages SGLang names ``page_hashes``."""
        return [page_key(self.root, h) for h in page_hashes]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the pool holds, from the watch cache; 0 while the pool is unreachable."""
        try:
            client, lookup, pages = self.connection.connected, self._lookup, self.pages
            if client is None or lookup is None or pages is None:
                self._io.submit(self._client)  # try again (at most every RETRY_S)
                return 0
            hit = lookup(client.cache, [[k] for k in self.keys(list(keys))])
            self.counts.add(lookup_tokens=hit.asked * pages.page, hit_tokens=hit.held * pages.page)
            if hit.cause is not None:
                self.counts.miss(hit.cause)
            return hit.held
        except Exception:  # never into SGLang's prefetch thread: a lookup that fails is 0 pages held
            log.exception("kvpool: page lookup failed; counted as 0 pages held")
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy pages (interface_v1) ------------------------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load pages ``keys`` into the host slots ``host_indices`` (``page_size`` a page); per page, whether it
        came (a page that did not is a miss: SGLang computes it)."""
        return self._on_io(lambda: self._load(list(keys), host_indices, None), [False] * len(keys), "load")

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Save the pages in host slots ``host_indices`` as ``keys``; per page, whether the pool holds it now."""
        return self._on_io(lambda: self._save(list(keys), host_indices, None), [False] * len(keys), "save")

    # -- flat pages (SGLang's generic path, without interface_v1) ----------------------------------------------

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Load pages into ``target_locations`` (flat data pages in the host's order, one a key); each the page
        loaded, or None where it did not come."""
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            log.error("kvpool: batch_get of %d keys with %d target pages; nothing loaded", len(keys), len(targets))
            return [None] * len(keys)
        got = self._on_io(lambda: self._load(list(keys), None, targets), [False] * len(keys), "load")
        return [t if ok else None for t, ok in zip(targets, got, strict=True)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        target = target_location if target_location is not None else self._flat_page()
        return self.batch_get([key], [target])[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Save flat data pages ``values`` (in the host's order) as ``keys``; whether every one is in the pool."""
        pages = list(values or [])
        if len(pages) != len(keys):
            log.error("kvpool: batch_set of %d keys with %d pages; nothing saved", len(keys), len(pages))
            return False
        return all(self._on_io(lambda: self._save(list(keys), None, pages), [False] * len(keys), "save"))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # -- the I/O thread ----------------------------------------------------------------------------------------

    def _on_io(self, work: Callable[[], list[bool]], failed: list[bool], what: str) -> list[bool]:
        """``work`` on the I/O thread, waited for; ``failed`` (counted) if it raises: never into SGLang's thread."""
        try:
            return self._io.submit(work).result()
        except Exception:
            log.exception("kvpool: page %s failed; counted as %d failed pages", what, len(failed))
            self.counts.add(**{f"{what}_errors": len(failed)})
            return failed

    def _client(self) -> Any:
        """The pool client (on the I/O thread), made when first needed: registers the cache identity and starts
        the lookups over its watch cache."""
        had = self.connection.connected
        client = self.connection.client()
        if client is not None and had is None:
            if self.identity is not None:
                with contextlib.suppress(KvPoolError):  # for kvpool status only: lookups work all the same
                    client.register_identity(self.identity)
            self._lookup = PrefixLookup(client.access_log)
        return client

    def _load(self, keys: list[str], host_indices: torch.Tensor | None, flats: list[Any] | None) -> list[bool]:
        """Pages ``keys`` from the pool into the host slots (``host_indices``) or flat pages (``flats``).  A page whose
        bytes lie in runs of at least ``MIN_RUN`` is read straight into them, wherever the pool holds it: from this
        node's segment, one copy checksummed as it lands; from a peer, one-sided READs into the host buffer itself
        (registered with the client's transport once it has one; until then, one checked copy out of the client's
        staging buffer); from NVMe or S3, into the runs too.  A page in shorter runs goes through the staging
        buffer: one copy out of the pool, one into the host pool's strided page."""
        started = time.perf_counter()
        pages, client = self.pages, self._client()
        if client is None or pages is None:
            self.counts.add(load_errors=len(keys))
            return [False] * len(keys)
        pool_keys = self.keys(keys)
        dests = self._dests(pages, keys, host_indices, flats)
        runs = [pages.runs(d, f) for d, f in zip(dests, flats or [None] * len(dests), strict=True)]
        register = client.registrations > 0  # the client has a transport: reads from peers land in place
        if register and flats is None and any(r is not None for r in runs):
            self._host.register(client, lambda: [] if self.pages is None else [self.pages.host_bytes])
        staged_at = {i: j for j, i in enumerate(i for i, r in enumerate(runs) if r is None)}
        staged = self._staged(client, len(staged_at), register=register)
        buffers = [r if r is not None else _flat(staged[staged_at[i]]) for i, r in enumerate(runs)]
        missing = read_each(client, pool_keys, buffers) if pool_keys else set()
        ok = [i not in missing for i in range(len(pool_keys))]
        for i, j in staged_at.items():
            if ok[i]:
                dests[i].copy_(staged[j])
        loaded, seconds = sum(ok), time.perf_counter() - started
        self.counts.add(loaded_tokens=loaded * pages.page, loaded_bytes=loaded * pages.nbytes, load_seconds=seconds)
        self._batch("prefetch", loaded, loaded * pages.nbytes, seconds)
        if loaded < len(keys):  # the pages were held when looked up, and could not be read
            self.counts.add(load_errors=len(keys) - loaded)
            self.counts.miss(MissCause.READ_FAILED, len(keys) - loaded)
        self.counts.report(client)
        return ok

    def _save(self, keys: list[str], host_indices: torch.Tensor | None, flats: list[Any] | None) -> list[bool]:
        """Pages from the host slots (``host_indices``) or flat pages (``flats``) into the pool as ``keys``; a page
        the pool holds already is not written again.  A page whose bytes lie in runs of at least ``MIN_RUN`` is
        gathered from them into the pool and checksummed as it lands (one pass over its bytes); one in shorter runs
        is copied into the staging buffer first.  The pages carry no tensor format: a tier with a codec keeps them
        raw."""
        if not self.storage_config.is_storage_writer:  # MLA: one rank writes what every rank reads
            return [True] * len(keys)
        started = time.perf_counter()
        pages, client = self.pages, self._client()
        if client is None or pages is None:
            self.counts.add(save_errors=len(keys))
            return [False] * len(keys)
        pool_keys = self.keys(keys)
        new = [i for i, k in enumerate(pool_keys) if not client.cache.replicas(k)]
        sources = self._dests(pages, keys, host_indices, flats)
        runs = {i: pages.runs(sources[i], None if flats is None else flats[i]) for i in new}
        staged_at = {i: j for j, i in enumerate(i for i in new if runs[i] is None)}
        staged = self._staged(client, len(staged_at))
        for i, j in staged_at.items():
            staged[j].copy_(sources[i])
        items = [(pool_keys[i], _flat(staged[staged_at[i]]) if runs[i] is None else runs[i]) for i in new]
        try:
            if items:
                client.put_batch(
                    items, replicas=self.config.replicas, tenant=self.config.tenant, identity=self.fingerprint
                )
        except KvPoolError as exc:  # a full pool, etcd or a node gone: a future miss, never an engine error
            log.warning("kvpool: could not save %d pages: %s", len(items), exc)
            self.counts.add(save_errors=len(items))
            self.counts.report(client)
            unsaved = set(new)
            return [i not in unsaved for i in range(len(keys))]
        seconds = time.perf_counter() - started
        self.counts.add(
            saved_tokens=len(items) * pages.page, saved_bytes=len(items) * pages.nbytes, save_seconds=seconds
        )
        self._batch("backup", len(items), len(items) * pages.nbytes, seconds)
        self.counts.report(client)
        return [True] * len(keys)

    def _staged(self, client: Any, pages: int, register: bool = False) -> torch.Tensor:
        """``pages`` pool objects' room in the reused staging buffer, as ``[pages, 2, layers, page, heads, dim]``."""
        layout = self.pages
        assert layout is not None
        if not pages:  # nothing to stage: the buffer is neither made nor registered
            return torch.empty((0, *layout.shape), dtype=layout.dtype)
        buffer = self._staging.get(client, pages * layout.nbytes, register=register)
        return buffer[: pages * layout.nbytes].view(layout.dtype).view(pages, *layout.shape)

    def _dests(
        self, pages: PageLayout, keys: list[str], host_indices: torch.Tensor | None, flats: list[Any] | None
    ) -> list[torch.Tensor]:
        """Each page's tensor in the pool object's order: a view of its host slots, or of its flat page."""
        if flats is not None:
            return [pages.canonical(f) for f in flats]
        assert host_indices is not None
        return [pages.view(s) for s in pages.starts(host_indices, len(keys))]

    def _flat_page(self) -> torch.Tensor:
        pages = self.pages
        if pages is None:
            raise ConfigError("KvPoolStorage.get before register_mem_pool_host: SGLang registers its host pool first")
        return torch.empty(pages.shape, dtype=pages.dtype).flatten()

    # -- the rest of SGLang's interface ------------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing is removed: the pool is shared, and flushing one server's cache must not take pages that other
        servers of the model use (``kvpool rm`` removes chunks by key)."""

    def _batch(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """Keep one batch's pages and bandwidth for SGLang's storage metrics (``--enable-storage-metrics``)."""
        if pages:
            with self._batches_lock:
                self._batches[f"{kind}_pgs"].append(pages)
                self._batches[f"{kind}_bandwidth"].append(nbytes / (1 << 30) / max(seconds, 1e-9))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the batches since it last asked: pages and GiB/s of each prefetch and backup
        (the pool node's metrics count the rest: ``kvpool_engine_*``)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._batches_lock:
            batches, self._batches = self._batches, {k: [] for k in _METRICS}
        return StorageMetrics(**batches)

    def close(self) -> None:
        """Stop the I/O thread and close the pool client (SGLang's detach calls it)."""
        with contextlib.suppress(Exception):
            self._io.submit(self._close_client).result(timeout=30)
        self._io.shutdown(wait=False)

    def _close_client(self) -> None:
        client = self.connection.connected
        if client is not None:
            self.counts.report(client)
            self._staging.close(client)
            self._host.close(client)
        self.connection.close()


def _flat(page: torch.Tensor) -> torch.Tensor:
    """A staged page as flat bytes (a put of them carries no tensor format, as a put of the runs does not)."""
    return page.view(torch.uint8).view(-1)


def _check_parallelism(cfg: HiCacheStorageConfig) -> None:
    """Refuse what this backend does not key or lay out yet, saying how to serve without it."""
    if cfg.attn_cp_size > 1 or cfg.dcp_size > 1 or cfg.should_split_heads:
        raise ConfigError(
            "KvPoolStorage does not support context parallelism or heterogeneous TP (split heads) yet: serve with "
            "attention CP and DCP of 1 and one TP size for every server"
        )


__all__ = ["KvPoolStorage"]
