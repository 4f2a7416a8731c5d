"""A whole local stack, brought up and torn down by one call: etcd, Ray, the pool, the demo service.

``running_pool`` starts an etcd (embedded, unless the config names endpoints) and Ray (a local cluster on
127.0.0.2 and up, unless it names a cluster to attach to), then one ``PoolNode`` per Ray node, and stops all
it started on exit.  ``demo_service`` puts a prefill worker and a decode worker on it.  ``kvpool up``,
``kvpool bench``, ``kvpool plan --measure``, the demo (``prefill_decode/reference/demo.py``) and tests call these; what
they print goes through a :class:`Report`, so the library itself stays quiet.
"""

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import msgspec
import ray
from msgspec import Meta

from kvpool import ray_auth
from kvpool.core.config import Config, Positive, checked, one_of
from kvpool.errors import ConfigError
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import PoolConfig
from kvpool.servers import watchdog

if TYPE_CHECKING:
    from kvpool.pool.tenants import Tenants
    from kvpool.prefill_decode.reference.service import Service
    from kvpool.prefill_decode.vllm.front import EngineFront

log = logging.getLogger(__name__)

#: what removes the segment files of pool nodes that are gone (the directories as arguments)
REAP = "import sys; from kvpool.pool.segment import reap_stale_segments; reap_stale_segments(*sys.argv[1:])"


class Report(Protocol):
    """Where a stack says what it is doing: a slow step (``busy``) and a step's outcome (``done``)."""

    def busy(self, what: str) -> AbstractContextManager[object]: ...

    def done(self, line: str) -> None: ...


class LogReport:
    """The default :class:`Report`: outcomes to this module's log, nothing while busy."""

    def busy(self, what: str) -> AbstractContextManager[object]:
        return nullcontext()

    def done(self, line: str) -> None:
        log.info("%s", line)


_RayAuth = Annotated[str, Meta(pattern=rf"^({'|'.join(ray_auth.MODES)})?\Z", description="token or disabled")]


class StackConfig(Config, frozen=True):
    """What to bring up.  ``pool.metadata.endpoints`` empty: an embedded etcd on a free loopback port."""

    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    #: Ray nodes of the local cluster, on 127.0.0.2 and up (unused with ``ray_address``)
    nodes: Annotated[int, Meta(ge=1, le=32, description="an int in [1, 32] (local Ray nodes)")] = 1
    ray_address: str = ""  #: attach to this Ray cluster (head host:port) and use its alive nodes; empty: a local one
    #: the local cluster's authentication: token or disabled; "": the user's ``RAY_AUTH_MODE``, else token (an attached
    #: cluster's is its own)
    ray_auth: _RayAuth = ""


def _etcd_up(stack: ExitStack, metadata: MetadataConfig, report: Report) -> MetadataConfig:
    if metadata.endpoints:
        return metadata
    from kvpool.servers.etcd import EmbeddedEtcd

    with report.busy("starting embedded etcd"):
        server = stack.enter_context(EmbeddedEtcd())
    report.done(f"etcd      embedded, {server.endpoint} (data in {server.data_dir})")
    return metadata.with_endpoints(server.endpoint)


def _ray_up(stack: ExitStack, config: StackConfig, report: Report) -> None:
    if not config.ray_address:
        from kvpool.servers.ray_cluster import LocalRayCluster

        with report.busy(f"starting a local Ray cluster of {config.nodes} node(s)"):
            cluster = stack.enter_context(LocalRayCluster(nodes=config.nodes, auth=config.ray_auth or None))
        auth = f"its token in {cluster.token_path}" if cluster.token_path else "authentication DISABLED"
        report.done(
            f"ray       local, {config.nodes} node(s) on {', '.join(cluster.ips)}, head {cluster.address}; {auth}"
        )
    elif ray.is_initialized() and ray.get_runtime_context().gcs_address == config.ray_address:
        report.done(f"ray       already attached to {config.ray_address}")  # kept attached on exit
    else:
        ray_auth.attach(config.ray_address)
        stack.callback(ray.shutdown)
        report.done(f"ray       attached to {config.ray_address}")


@contextmanager
def running_pool(config: StackConfig, report: Report | None = None) -> Iterator[PoolConfig]:
    """A running pool as ``config`` asks (etcd, Ray, a ``PoolNode`` per Ray node); yields its ``PoolConfig``
    (with the etcd endpoint filled in) and stops everything it started on exit."""
    report = report or LogReport()
    with ExitStack() as stack:
        pool = msgspec.structs.replace(config.pool, metadata=_etcd_up(stack, config.pool.metadata, report))
        _ray_up(stack, config, report)
        remote = pool.remote
        if remote.enabled:
            report.done(f"remote    S3 bucket {remote.bucket}, {remote.codec}, after {remote.flush_after_s:g} s idle")
        from kvpool.pool.node import start_pool, stop_pool

        with report.busy("starting PoolNode actors"):
            start_pool(pool)
        stack.callback(stop_pool, pool)
        # if this process is killed, its watchdog stops Ray (and with it the PoolNodes), then removes their segments
        watchdog.at_end([sys.executable, "-c", REAP, pool.shm_dir, pool.nvme_dir or tempfile.gettempdir()])
        yield pool


@dataclass(frozen=True)
class PoolCheck:
    """What :func:`check_pool` saw."""

    chunks: int  #: chunks put, of ``chunk_bytes`` each
    chunk_bytes: int
    found: int  #: chunks of the chain a prefix lookup found
    put_s: float
    get_s: float
    verified: bool  #: every chunk came back with the bytes put


def check_pool(pool: PoolConfig, chunks: int = 16) -> PoolCheck:
    """Put ``chunks`` chunks of 1 MiB, look the chain up, read them back and compare: the pool works end to end."""
    import numpy as np

    from kvpool.core.keys import CacheIdentity, chunk_keys
    from kvpool.pool.client import PoolClient

    ident = CacheIdentity(model="kvpool-check", kv_dtype="uint8", layout="bytes", chunk_size=256)
    keys = chunk_keys(ident, np.arange(256 * chunks) % 50_000)
    data = [np.random.default_rng(i).integers(0, 256, 2**20, dtype=np.uint8) for i in range(len(keys))]
    with PoolClient(pool) as client:
        t0 = time.perf_counter()
        client.put_batch(list(zip(keys, data, strict=True)))
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = client.get_batch(keys)
        get_s = time.perf_counter() - t0
        verified = all(b == d.tobytes() for b, d in zip(back, data, strict=True))
        found = client.lookup_prefix(keys)
    return PoolCheck(len(keys), 2**20, found, put_s, get_s, verified)


@contextmanager
@checked
def demo_service(
    pool: PoolConfig,
    model: str,
    report: Report | None = None,
    lanes: Positive = 1,
    policy: str = "cache-aware",
    tenants: "Tenants | None" = None,
) -> "Iterator[Service]":
    """``lanes`` prefill workers, lane ``i``'s on Ray node ``i`` and its decode worker on the next node (one lane:
    prefill on the first node, decode on the last), and the ``Service`` over them, routing by ``policy`` when
    there are several (and serving ``tenants``' requests only, when given); the workers are killed on exit."""
    from kvpool.metadata.cache import MetadataCache
    from kvpool.metadata.client import EtcdClient
    from kvpool.metadata.namespace import Namespace
    from kvpool.prefill_decode.reference.model import load_tokenizer
    from kvpool.prefill_decode.reference.service import Lane, Service, lane_router
    from kvpool.prefill_decode.reference.workers import WorkerConfig, start_lanes
    from kvpool.prefill_decode.routing.router import Policy

    report = report or LogReport()
    policy = Policy.of(policy).value
    ids = sorted((n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes() if n["Alive"])
    pairs = [(ids[i % len(ids)], ids[(i + 1) % len(ids) if lanes > 1 else -1]) for i in range(lanes)]
    config = WorkerConfig(pool=pool, model=model, torch_threads=max(1, (os.cpu_count() or 1) // lanes))
    where = ", ".join(f"{p_ip} -> {d_ip}" for (p_ip, _), (d_ip, _) in pairs)
    with ExitStack() as stack:
        with report.busy(f"loading {model} on {lanes} prefill -> decode lane(s) ({where}), measuring"):
            started = start_lanes(config, [(p_id, d_id) for (_, p_id), (_, d_id) in pairs])
            stack.callback(lambda: [ray.kill(w) for pair in started for w in pair])
            tokenizer = load_tokenizer(model)
        hw = ray.get(started[0][0].hardware.remote())
        paths = ", ".join(f"{t} {bw / 1e9:.2f} GB/s" for t, bw in hw.bandwidth.items())
        report.done(f"workers   {model}: {lanes} lane(s), prefill -> decode {where}")
        report.done(f"cost      {hw.source}: {hw.flops / 1e9:.1f} GFLOP/s effective; {paths}")
        router = None
        if lanes > 1:
            etcd = EtcdClient(pool.metadata)
            stack.callback(etcd.close)
            cache = stack.enter_context(MetadataCache(etcd, Namespace(pool.metadata.cluster)))
            router = lane_router([Lane(*pair) for pair in started], cache.replicas, policy)
            report.done(f"routing   {policy} over {lanes} lanes")
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        served = [Lane(*pair) for pair in started]
        yield Service(served, model=model, tokenizer=tokenizer, eos=eos, router=router, tenants=tenants)


def serve(service: "Service", port: int, report: Report | None = None) -> None:
    """Serve OpenAI-style ``/v1/completions`` over ``service`` on 127.0.0.1:``port`` (0: any) until Ctrl-C."""
    from kvpool.prefill_decode.reference.service import make_app

    _run_app(make_app(service), port, report, "")


def _run_app(app: Any, port: int, report: Report | None, over: str) -> None:
    from aiohttp import web

    report = report or LogReport()
    report.done(f"serving   http://127.0.0.1:{port or '<any>'}/v1/completions{over} (Ctrl-C stops)")
    web.run_app(app, host="127.0.0.1", port=port, print=lambda m: report.done(f"          {m}"))


@dataclass(frozen=True)
class EngineService:
    """vLLM engines behind a router (:func:`engine_service`): what :func:`serve_engines` serves."""

    front: "EngineFront"
    model: str
    tokenizer: Any
    vocab: int


@contextmanager
@checked
def engine_service(
    pool: PoolConfig,
    model: str,
    report: Report | None = None,
    engines: Positive = 1,
    policy: str = "cache-aware",
    chunk_size: int = 256,
) -> "Iterator[EngineService]":
    """One vLLM engine (CPU) with kvpool's connector per Ray node, ``engines`` of them, on this machine, their KV
    events to a socket on the first node's address, their cost models measured, and the router over them."""
    from kvpool.metadata.cache import MetadataCache
    from kvpool.metadata.client import EtcdClient
    from kvpool.metadata.namespace import Namespace
    from kvpool.prefill_decode.reference.model import converted_smollm2, load_tokenizer
    from kvpool.prefill_decode.routing.engine_router import EngineEvents
    from kvpool.prefill_decode.routing.router import Policy
    from kvpool.prefill_decode.vllm.front import EngineFront, Prefetcher, calibrate, model_spec, start_engine_lanes

    report = report or LogReport()
    policy = Policy.of(policy).value
    one_of(["smollm2-135m"], model, "model of the vLLM engines (its weights ship with kvpool)")
    ips = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if engines > len(ips):
        raise ConfigError(f"engines: one per Ray node, so at most {len(ips)} here, got {engines}")
    directory = converted_smollm2()
    vocab = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    connector = {
        "etcd": list(pool.metadata.endpoints),
        "cluster": pool.metadata.cluster,
        "namespace": pool.namespace,
        "ray_address": ray.get_runtime_context().gcs_address,
        "model_id": model,
        "chunk_size": chunk_size,
    }
    with ExitStack() as stack:
        events = EngineEvents(f"tcp://{ips[0]}:*", [f"engine{i}" for i in range(engines)])
        stack.callback(events.close)
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-engines-")))
        with report.busy(f"starting {engines} vLLM engine(s) of {model} on {', '.join(ips[:engines])}"):
            lanes = start_engine_lanes({"model": str(directory)}, connector, ips[:engines], events.endpoint, logs)
            for lane in lanes:
                stack.callback(lane.engine.close)
        report.done(f"engines   vLLM {model}: {engines} engine(s), KV events to {events.endpoint}")
        with report.busy("measuring each engine: cold, from its own cache, from its node's pool and another's"):
            costs = calibrate(lanes, model_spec(directory), chunk_size)
        hw = costs[0].hardware
        paths = ", ".join(f"{t} {bw / 1e9:.2f} GB/s" for t, bw in hw.bandwidth.items())
        report.done(
            f"cost      {hw.source}: {hw.flops / 1e9:.1f} GFLOP/s effective, step {hw.step_s * 1e3:.0f} ms; {paths}"
        )
        etcd = EtcdClient(pool.metadata)
        stack.callback(etcd.close)
        cache = stack.enter_context(MetadataCache(etcd, Namespace(pool.metadata.cluster)))
        prefetcher = Prefetcher(pool)
        stack.callback(prefetcher.close)
        front = EngineFront.over(lanes, events, costs, cache.replicas, chunk_size, policy, prefetcher)
        report.done(f"routing   {policy} over {engines} engine(s)")
        yield EngineService(front, model, load_tokenizer(model), vocab)


def serve_engines(service: EngineService, port: int, report: Report | None = None) -> None:
    """Serve OpenAI-style ``/v1/completions`` over vLLM engines on 127.0.0.1:``port`` (0: any) until Ctrl-C."""
    from kvpool.prefill_decode.vllm.front import make_engine_app

    app = make_engine_app(service.front, service.model, service.tokenizer, service.vocab)
    _run_app(app, port, report, " over vLLM engines")
