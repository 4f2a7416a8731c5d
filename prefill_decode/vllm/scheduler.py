"""The scheduler side of :class:`~kvpool.prefill_decode.vllm.connector.KvPoolConnector`: prefix lookups in the
etcd watch cache and, each step, the plan of loads and saves it sends the workers (:class:`KvPoolMetadata`)."""

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.errors import KvPoolError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.identities import register as register_identity
from kvpool.metadata.lookup import Hit, PrefixLookup
from kvpool.metadata.namespace import Namespace
from kvpool.pool.advisor import AccessLog
from kvpool.prefill_decode.connector_core.counts import EngineCounts
from kvpool.prefill_decode.connector_core.tenancy import TenantScope
from kvpool.prefill_decode.vllm.config import ConnectorConfig

log = logging.getLogger(__name__)

RETRY_S = 5.0  #: a side whose etcd or pool could not be reached tries again after this (meanwhile: 0 hits)


# -- what the scheduler tells the workers, each step ------------------------------------------------------------


@dataclass
class Transfer:
    """Chunks ``[first, end)`` of a request's prompt and the blocks they occupy (``block_ids[i]`` holds tokens
    ``i * block_size ...``).  A load writes only blocks from ``write_from`` on: those before are vLLM's own
    prefix-cache hits, shared with other requests."""

    req_id: str
    tokens: list[int]  #: the prompt's first ``end * chunk_size`` tokens
    first: int
    end: int
    block_ids: list[int]
    write_from: int = 0
    #: a load whose last chunk reaches into what vLLM computes this step (the prompt's last token): done before the
    #: forward starts, so vLLM's own KV write of that token (before attention, not ordered with layer loads) wins
    whole_before_forward: bool = False
    tenant: str = ""  #: whose chain the chunks are keyed in (the request's cache_salt named the tenant's API key)


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
    computed: int = 0  #: tokens vLLM had computed itself when the pool was asked
    held: int = 0  #: leading chunks the pool held then
    load: tuple[int, int] | None = None  #: tokens ``[from, to)`` to load this step, once vLLM allocated their blocks
    running: bool = False  #: scheduled: ``tokens`` and ``block_ids`` are known
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  #: chunks already in the pool or queued for saving
    saving: bool = False  #: saves were sent to the workers: vLLM keeps its blocks until they are done


class SchedulerSide:
    """Lookups in the watch cache and the per-step plan of loads and saves."""

    def __init__(
        self,
        config: ConnectorConfig,
        identities: list[CacheIdentity],
        layers: int,
        block_size: int,
        loads_kv: bool = True,
        saves_kv: bool = True,
    ) -> None:
        self.config, self.identities, self.layers, self.block_size = config, identities, layers, block_size
        self.loads_kv, self.saves_kv = loads_kv, saves_kv
        self.chunk = config.chunk_size
        self.cache: MetadataCache | None = None
        self._connecting = threading.Lock()
        self._next_try = 0.0
        self._requests: dict[str, RequestTracker] = {}
        self.tenants = TenantScope.load(config.tenants)
        self.lookup = PrefixLookup(AccessLog.from_env())  #: sampled lookups for kvpool advise (KVPOOL_ACCESS_LOG)
        self.counts = EngineCounts()  #: handed to the workers with each step's plan
        self._connect()

    def _connect(self) -> None:
        """Start the watch cache on a thread (etcd may be down: until it answers, every lookup is 0 hits)."""
        if self.cache is not None or time.monotonic() < self._next_try or not self._connecting.acquire(blocking=False):
            return
        self._next_try = time.monotonic() + RETRY_S

        def connect() -> None:
            try:
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

        threading.Thread(target=connect, name="kvpool-connector-etcd", daemon=True).start()

    def held_chunks(self, tokens: list[int], limit: int, tenant: str = "") -> Hit:
        """Leading chunks of ``tokens`` (at most ``limit``) whose every layer, on every TP rank, the pool holds (in
        ``tenant``'s chain)."""
        cache = self.cache
        if cache is None:
            self._connect()
            return Hit(limit, 0)
        scope = self.tenants.scope(tenant)
        ranks = [chunk_keys(identity, tokens[: limit * self.chunk], scope) for identity in self.identities]
        layers = range(self.layers)
        return self.lookup(cache, [[layer_key(keys[c], x) for keys in ranks for x in layers] for c in range(limit)])

    def matched(self, request: Any, num_computed: int) -> int:
        tokens = list(request.prompt_token_ids or [])
        tenant = self.tenants.tenant_of(getattr(request, "cache_salt", None))
        req = self._requests.setdefault(request.request_id, RequestTracker(tenant))
        req.tenant, req.computed, req.held = tenant, num_computed, 0
        if tenant is None:
            return 0
        hit = self.held_chunks(tokens, len(tokens) // self.chunk, tenant)
        self.counts.lookup(hit, len(tokens), self.chunk)
        req.held = hit.held
        if not self.loads_kv:
            return 0
        # vLLM computes at least the last prompt token itself: a prompt whose every chunk is held loads them all
        # and has vLLM compute its last token again (its KV slot is then written twice, with the same values)
        return max(min(hit.held * self.chunk, len(tokens) - 1) - num_computed, 0)

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        req = self._requests.get(request.request_id)
        if num_external_tokens > 0 and req is not None:
            req.load = (req.computed, req.computed + num_external_tokens)

    def build(self, out: Any) -> KvPoolMetadata:
        meta = KvPoolMetadata(preempted=set(getattr(out, "preempted_req_ids", None) or ()), counts=self.counts.take())
        computed: dict[str, int] = {}  #: tokens computed before this step, of each running request scheduled in it
        for new in out.scheduled_new_reqs:
            req = self._requests.setdefault(new.req_id, RequestTracker(""))
            if req.tenant is None:  # refused: no loads were planned; nothing is saved
                continue
            req.running, req.tokens, req.block_ids = True, list(new.prompt_token_ids or []), list(new.block_ids[0])
            req.saved = req.held
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._requests.get(req_id)
            if running is None or not running.running:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption every block is new (its saves were drained)
                running.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                running.block_ids += new_blocks[0]
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id in computed:
            load, self._requests[req_id].load = self._requests[req_id].load, None
            if load is not None:
                meta.loads.append(self._load(req_id, self._requests[req_id], load))
        if self.saves_kv:
            meta.saves = [t for req_id, done in computed.items() if (t := self._save(req_id, done, out)) is not None]
        for req in self._requests.values():
            req.load = None  # planned for a request vLLM did not schedule after all
        return meta

    def _load(self, req_id: str, req: RequestTracker, load: tuple[int, int]) -> Transfer:
        computed, end_token = load
        first, end = computed // self.chunk, -(-end_token // self.chunk)  # the last chunk may end 1 token later
        return Transfer(
            req_id,
            req.tokens[: end * self.chunk],
            first,
            end,
            req.block_ids[: end * (self.chunk // self.block_size)],
            write_from=computed // self.block_size,
            whole_before_forward=end * self.chunk > end_token,
            tenant=req.tenant or "",
        )

    def _save(self, req_id: str, done: int, out: Any) -> Transfer | None:
        """The chunks of a running request that are complete after this step and not saved yet, if any."""
        req, bpc = self._requests[req_id], self.chunk // self.block_size
        after = min(done + out.num_scheduled_tokens.get(req_id, 0), len(req.tokens))
        full = min(after // self.chunk, len(req.block_ids) // bpc)
        if full <= req.saved:
            return None
        first, req.saved, req.saving = req.saved, full, True
        tokens, blocks = req.tokens[: full * self.chunk], req.block_ids[: full * bpc]
        return Transfer(req_id, tokens, first, full, blocks, tenant=req.tenant or "")

    def finished(self, req_id: str) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report its saves done."""
        req = self._requests.pop(req_id, None)
        return req is not None and req.saving

    def close(self) -> None:
        self.lookup.close()
        if self.cache is not None:
            self.cache.close()
            self.cache.etcd.close()
