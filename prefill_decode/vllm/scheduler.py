"""The scheduler side of :class:`~kvpool.prefill_decode.vllm.connector.KvPoolConnector`: prefix lookups in the
etcd watch cache and, each step, the plan of loads and saves it sends the workers (:class:`KvPoolMetadata`)."""

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.errors import ConfigError, KvPoolError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient, probe
from kvpool.metadata.identities import register as register_identity
from kvpool.metadata.lookup import Hit, PrefixLookup
from kvpool.metadata.misses import miss_cause
from kvpool.metadata.namespace import Namespace
from kvpool.pool.advisor import AccessLog
from kvpool.prefill_decode.connector_core.connection import START_WAIT_S, PoolConnection
from kvpool.prefill_decode.connector_core.counts import EngineCounts
from kvpool.prefill_decode.connector_core.prefetch import RequestPrefetches
from kvpool.prefill_decode.connector_core.tenancy import TenantScope
from kvpool.prefill_decode.vllm.config import ConnectorConfig
from kvpool.prefill_decode.vllm.events import PoolEvents
from kvpool.prefill_decode.vllm.groups import KvGroups, PoolLayer
from kvpool.prefill_decode.vllm.hint import pool_hint

log = logging.getLogger(__name__)

RETRY_S = 5.0  #: a side whose etcd or pool could not be reached tries again after this (meanwhile: 0 hits)


# -- what the scheduler tells the workers, each step ------------------------------------------------------------


@dataclass
class Transfer:
    """Chunks ``[first, end)`` of a request's prompt and the blocks they occupy, per KV-cache group
    (``block_ids[group][i]`` holds tokens ``i * block_size ...``).  A load writes only blocks from ``write_from`` on:
    those before are vLLM's own prefix-cache hits, shared with other requests."""

    req_id: str
    tokens: list[int]  #: the prompt's first ``end * chunk_size`` tokens
    first: int
    end: int
    block_ids: list[list[int]]
    write_from: int = 0
    #: a load whose last chunk reaches into what vLLM computes this step (the prompt's last token): done before the
    #: forward starts, so vLLM's own KV write of that token (before attention, not ordered with layer loads) wins
    whole_before_forward: bool = False
    tenant: str = ""  #: whose chain the chunks are keyed in (the request's cache_salt named the tenant's API key)
    #: a load vLLM waits for before it schedules the request (models of several KV-cache groups: vLLM takes their
    #: failed loads per request only), reported done or failed by ``get_transfer_results``
    whole_request: bool = False
    #: a save, with KV events on: vLLM's hashes of the prompt's blocks up to ``end``, for the workers' reports
    hashes: list[Any] = field(default_factory=list)


@dataclass
class KvPoolMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    #: the scheduler's counts since the last step (lookups, misses by cause): the workers report them to the pool
    counts: dict[str, float] = field(default_factory=dict)


@dataclass
class RequestTracker:
    """One request on the scheduler side, from its lookup to its end."""

    tenant: str | None  #: whose chain its chunks are in ("": none); None: refused, the pool is not used for it
    #: its ``kv_transfer_params`` ask for its held prefix in this engine's node's DRAM before it is loaded (:mod:`.hint`)
    prefetch: bool = False
    computed: int = 0  #: tokens vLLM had computed itself when the pool was asked
    held: int = 0  #: leading chunks the pool held then
    load: tuple[int, int] | None = None  #: tokens ``[from, to)`` to load this step, once vLLM allocated their blocks
    running: bool = False  #: scheduled: ``tokens`` and ``block_ids`` are known
    tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  #: per KV-cache group
    saved: int = 0  #: chunks already in the pool or queued for saving
    saving: bool = False  #: saves were sent to the workers: vLLM keeps its blocks until they are done
    #: a whole-request load was sent: asked again (it failed, or the request was preempted), vLLM computes it all
    whole_loaded: bool = False
    hashes: list[Any] = field(default_factory=list)  #: vLLM's hashes of the prompt's full blocks (KV events on)


class SchedulerSide:
    """Lookups in the watch cache and the per-step plan of loads and saves."""

    def __init__(
        self,
        config: ConnectorConfig,
        identities: list[CacheIdentity],
        groups: KvGroups,
        loads_kv: bool = True,
        saves_kv: bool = True,
        events: PoolEvents | None = None,
    ) -> None:
        self.config, self.identities, self.groups, self.block_size = config, identities, groups, groups.block_size
        self.events = events  #: the pool's chunks in vLLM's KV events (None: vLLM publishes none)
        self.loads_kv, self.saves_kv = loads_kv, saves_kv
        #: loads a request waits for, planned when vLLM allocated its blocks (models of several KV-cache groups)
        self.async_loads = len({layer.group for layer in groups.layers}) > 1
        self._whole: list[Transfer] = []
        self.chunk = config.chunk_size
        self.cache: MetadataCache | None = None
        self._connecting = threading.Lock()
        self._next_try = 0.0
        self._requests: dict[str, RequestTracker] = {}
        self.tenants = TenantScope.load(config.tenants)
        self.lookup = PrefixLookup(AccessLog.from_env())  #: sampled lookups for kvpool advise (KVPOOL_ACCESS_LOG)
        self.counts = EngineCounts()  #: handed to the workers with each step's plan
        #: prefetches hinted requests wait for, with a pool client of their own (made on the first)
        self.prefetches = RequestPrefetches(PoolConnection(config), self.counts, config.prefetch_wait_s)
        if (connecting := self._connect()) is not None:
            connecting.join(START_WAIT_S)  # the engine starts with its lookups ready (or without, after this)

    def _connect(self) -> threading.Thread | None:
        """Start the watch cache on a thread (etcd may be down: until it answers, every lookup is 0 hits); the thread,
        or None if one runs already or the last attempt was too recent."""
        if self.cache is not None or time.monotonic() < self._next_try or not self._connecting.acquire(blocking=False):
            return None
        self._next_try = time.monotonic() + RETRY_S

        def connect() -> None:
            try:
                probe(self.config.metadata())  # nothing listening where etcd should be: 0 hits now, not after retries
                etcd = EtcdClient(self.config.metadata())
                try:
                    self.cache = MetadataCache(etcd, Namespace(self.config.cluster)).start()
                except BaseException:
                    etcd.close()
                    raise
                try:  # for kvpool status: what keys this engine's chunks
                    for identity in self.identities:
                        register_identity(etcd, self.cache.namespace, identity)
                except KvPoolError as exc:
                    log.warning("kvpool: cache identity not registered (%s); lookups work all the same", exc)
            except KvPoolError as exc:
                log.warning("kvpool: no pool metadata yet (%s); 0 hits until etcd answers", exc)
            finally:
                self._connecting.release()

        thread = threading.Thread(target=connect, name="kvpool-connector-etcd", daemon=True)
        thread.start()
        return thread

    def held_chunks(self, tokens: list[int], limit: int, tenant: str = "") -> Hit:
        """Leading chunks of ``tokens`` (at most ``limit``) whose every layer, on every TP rank, the pool holds (in
        ``tenant``'s chain); of a sliding-window layer, the chunks inside the window of the prefix's end."""
        cache = self.cache
        if cache is None:
            self._connect()
            return Hit(limit, 0)
        ranks = self._chain(tokens, limit, tenant)
        full = [layer.index for layer in self.groups.layers if not layer.window]
        hit = self.lookup(cache, [[layer_key(keys[c], x) for keys in ranks for x in full] for c in range(limit)])
        windowed = [layer for layer in self.groups.layers if layer.window]
        held = hit.held
        while windowed and held and cache.lookup_prefix(keys := self._window_keys(ranks, windowed, held)) < len(keys):
            held -= 1
        if held == hit.held:
            return hit
        return Hit(hit.asked, held, miss_cause(cache, self._window_keys(ranks, windowed, held + 1))[0])

    def _chain(self, tokens: list[int], chunks: int, tenant: str) -> list[list[bytes]]:
        """Each TP rank's chain keys of the first ``chunks`` chunks of ``tokens``, in ``tenant``'s chain."""
        scope = self.tenants.scope(tenant)
        return [chunk_keys(identity, tokens[: chunks * self.chunk], scope) for identity in self.identities]

    def _load_objects(self, tokens: list[int], first: int, end: int, tenant: str) -> list[bytes]:
        """The pool objects a load of chunks ``[first, end)`` reads: each full-attention layer's, and the
        sliding-window layers' inside the window of ``end``."""
        if end <= first:
            return []
        ranks = self._chain(tokens, end, tenant)
        full = [layer.index for layer in self.groups.layers if not layer.window]
        windowed = [layer for layer in self.groups.layers if layer.window]
        objects = [layer_key(keys[c], x) for c in range(first, end) for keys in ranks for x in full]
        return objects + self._window_keys(ranks, windowed, end)

    def _window_keys(self, ranks: list[list[bytes]], windowed: list[PoolLayer], end: int) -> list[bytes]:
        """The objects of sliding-window layers a prefix of ``end`` chunks needs."""
        first = self.groups.first_chunk
        return [
            layer_key(keys[c], layer.index)
            for layer in windowed
            for keys in ranks
            for c in range(first(layer, end), end)
        ]

    def matched(self, request: Any, num_computed: int) -> int | None:
        """The prompt tokens beyond ``num_computed`` the pool supplies; None while the request waits for its
        prefetch (vLLM asks again at a later step)."""
        tokens = list(request.prompt_token_ids or [])
        tenant = self.tenants.tenant_of(getattr(request, "cache_salt", None))
        if self.groups.unserved:
            tenant = None  # the pool serves this model nothing (KvGroups.unserved says why, once, at start)
        req = self._requests.get(request.request_id)
        if req is None:
            req = self._requests[request.request_id] = RequestTracker(tenant, self.loads_kv and self._hinted(request))
        req.tenant, req.computed, req.held = tenant, num_computed, 0
        if tenant is None or req.whole_loaded:
            return 0
        hit = self.held_chunks(tokens, len(tokens) // self.chunk, tenant)
        if req.prefetch and self._prefetching(request.request_id, tokens, num_computed, hit.held, tenant):
            return None
        req.hashes = self.events.hashes(request) if self.events is not None and self.saves_kv else []
        self.counts.lookup(hit, len(tokens), self.chunk)
        req.held = hit.held
        if not self.loads_kv:
            return 0
        # vLLM computes at least the last prompt token itself: a prompt whose every chunk is held loads them all
        # and has vLLM compute its last token again (its KV slot is then written twice, with the same values)
        return max(min(hit.held * self.chunk, len(tokens) - 1) - num_computed, 0)

    def _hinted(self, request: Any) -> bool:
        """Whether the request's ``kv_transfer_params`` ask for a prefetch; a malformed hint is logged and counted
        (``prefetch_bad_hint``) and asks for nothing."""
        try:
            return pool_hint(getattr(request, "kv_transfer_params", None)).prefetch
        except ConfigError as exc:
            self.counts.add(prefetch_bad_hint=1)
            log.warning("kvpool: request %s: %s; it is served without the hint", request.request_id, exc)
            return False

    def _prefetching(self, req_id: str, tokens: list[int], computed: int, held: int, tenant: str) -> bool:
        """Whether a hinted request waits for the prefetch of the held chunks vLLM has not computed, started at its
        first lookup where some of them are not in this engine's node's DRAM."""
        if self.cache is not None and not self.prefetches.started(req_id):
            keys = self._load_objects(tokens, computed // self.chunk, held, tenant)
            if not self.prefetches.needed(keys, self.cache):
                return False
            self.prefetches.start(req_id, keys, tenant)
        return self.prefetches.waiting(req_id)

    def allocated(self, request: Any, num_external_tokens: int, block_ids: Sequence[Sequence[int]] = ()) -> None:
        """vLLM gave the request its blocks (``block_ids``: per KV-cache group), for ``num_external_tokens`` to load."""
        req = self._requests.get(request.request_id)
        if num_external_tokens <= 0 or req is None:
            return
        load = (req.computed, req.computed + num_external_tokens)
        if not self.async_loads:
            req.load = load  # sent with the step that schedules the request
            return
        req.tokens, req.block_ids = list(request.prompt_token_ids or []), [list(ids) for ids in block_ids]
        req.whole_loaded = True
        self._whole.append(self._load(request.request_id, req, load, whole_request=True))

    def build(self, out: Any) -> KvPoolMetadata:
        meta = KvPoolMetadata(preempted=set(getattr(out, "preempted_req_ids", None) or ()), counts=self.counts.take())
        computed: dict[str, int] = {}  #: tokens computed before this step, of each running request scheduled in it
        for new in out.scheduled_new_reqs:
            req = self._requests.setdefault(new.req_id, RequestTracker(""))
            if req.tenant is None:  # refused: no loads were planned; nothing is saved
                continue
            req.running, req.tokens = True, list(new.prompt_token_ids or [])
            req.block_ids = [list(ids) for ids in new.block_ids]
            req.saved = req.held
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._requests.get(req_id)
            if running is None or not running.running:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption every block is new (its saves were drained)
                running.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                for ids, more in zip(running.block_ids, new_blocks, strict=True):
                    ids += more
            computed[req_id] = cached.num_computed_tokens[i]
        meta.loads, self._whole = self._whole, []
        for req_id in computed:
            load, self._requests[req_id].load = self._requests[req_id].load, None
            if load is not None:
                meta.loads.append(self._load(req_id, self._requests[req_id], load))
        if self.saves_kv:
            meta.saves = [t for req_id, done in computed.items() if (t := self._save(req_id, done, out)) is not None]
        for req in self._requests.values():
            req.load = None  # planned for a request vLLM did not schedule after all
        return meta

    def _load(self, req_id: str, req: RequestTracker, load: tuple[int, int], whole_request: bool = False) -> Transfer:
        computed, end_token = load
        first, end = computed // self.chunk, -(-end_token // self.chunk)  # the last chunk may end 1 token later
        return Transfer(
            req_id,
            req.tokens[: end * self.chunk],
            first,
            end,
            [ids[: end * self.groups.blocks_per_chunk] for ids in req.block_ids],
            write_from=computed // self.block_size,
            whole_before_forward=end * self.chunk > end_token,
            tenant=req.tenant or "",
            whole_request=whole_request,
        )

    def _save(self, req_id: str, done: int, out: Any) -> Transfer | None:
        """The chunks of a running request that are complete after this step and not saved yet, if any."""
        req, bpc = self._requests[req_id], self.groups.blocks_per_chunk
        after = min(done + out.num_scheduled_tokens.get(req_id, 0), len(req.tokens))
        full = min([after // self.chunk] + [len(req.block_ids[layer.group]) // bpc for layer in self.groups.layers])
        if full <= req.saved:
            return None
        first, req.saved, req.saving = req.saved, full, True
        tokens, blocks = req.tokens[: full * self.chunk], [ids[: full * bpc] for ids in req.block_ids]
        hashes = req.hashes[: full * bpc]
        if self.events is not None and hashes:
            keys = chunk_keys(self.identities[0], tokens, self.tenants.scope(req.tenant or ""))
            self.events.expect(hashes, keys[first:], first)
        return Transfer(req_id, tokens, first, full, blocks, tenant=req.tenant or "", hashes=hashes)

    def finished(self, req_id: str) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report its saves done."""
        req = self._requests.pop(req_id, None)
        self.prefetches.forget(req_id)
        return req is not None and req.saving

    def close(self) -> None:
        self.prefetches.close()
        self.lookup.close()
        if self.cache is not None:
            self.cache.close()
            self.cache.etcd.close()
