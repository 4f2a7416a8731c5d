"""The KV-cache layers the serving bench puts below its engines, each as users deploy it with vLLM.

A layer is a context manager ``factory(args, work) -> Layer``: while it is open the layer's own servers run (a pool,
a store); the engines it configures are started by the harness.  A layer that cannot start here (a peer not
installed) raises ``LayerUnavailable`` with what to do, and its rows say so instead of crashing the run.
"""

import argparse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.servers.process import Ready, ServerProcess


class LayerUnavailable(Exception):
    """A layer that cannot run on this host; the message says why and how to install it."""


@dataclass
class Server:
    """One of a layer's own server processes (a store's master, a segment holder), for the chaos bench to stop and
    kill: the process, and the check that says it serves again once started anew."""

    process: ServerProcess
    ready: Ready


@dataclass
class Layer:
    """What the harness needs of a running layer."""

    #: the ``--kv-transfer-config`` of engine ``i`` on ``host`` (None: vLLM's own prefix cache alone)
    kv_transfer: Callable[[int, str], dict[str, Any] | None]
    #: what empties the layer between runs (each run starts cold)
    empty: Callable[[], None] = lambda: None
    #: environment the engines need beside the harness's (a config path, library paths)
    env: dict[str, str] = field(default_factory=dict)
    #: how this layer ran, for the table's caption (e.g. "LMCache's copies through kvpool's CPU connector")
    note: str = ""
    #: the layer's cache lives inside the engines (LMCache's local CPU backend): each run starts fresh engines, as
    #: nothing else empties it
    in_engines: bool = False
    #: the layer's own server processes by name, where they are processes the harness started (Mooncake Store's)
    servers: dict[str, Server] = field(default_factory=dict)


Factory = Callable[[argparse.Namespace, Path], AbstractContextManager[Layer]]


@contextmanager
def none(args: argparse.Namespace, work: Path) -> Iterator[Layer]:
    """vLLM's own prefix cache, nothing below it: the baseline."""
    yield Layer(kv_transfer=lambda i, host: None)


@contextmanager
def kvpool(args: argparse.Namespace, work: Path) -> Iterator[Layer]:
    """A local pool of ``--engines`` Ray nodes (``--pool-mib`` of DRAM each), every engine's connector on its node
    with chunks of ``--kvpool-chunk`` tokens;
    or ``args.pool``, a pool running already (one node an engine on 127.0.0.2 and up: the tests' session pool)."""
    import ray

    from kvpool.pool.config import MiB, PoolConfig
    from kvpool.prefill_decode.vllm.config import ConnectorConfig, kv_transfer_config
    from kvpool.stack import StackConfig, running_pool

    stack = StackConfig(nodes=args.engines, pool=PoolConfig(dram_bytes=args.pool_mib * MiB, nvme_bytes=-1))
    with nullcontext(args.pool) if args.pool is not None else running_pool(stack) as pool:
        extra = {
            "etcd": list(pool.metadata.endpoints),
            "cluster": pool.metadata.cluster,
            "namespace": pool.namespace,
            "ray_address": ray.get_runtime_context().gcs_address,
            "model_id": "bench-serve",
            "chunk_size": args.kvpool_chunk,
            "layerwise": args.kvpool_layerwise,
        }

        def config(i: int, host: str) -> dict[str, Any]:
            return kv_transfer_config(ConnectorConfig.from_extra({**extra, "node_ip": host}))

        yield Layer(kv_transfer=config, empty=lambda: _empty_pool(pool))


def _empty_pool(pool: Any) -> None:
    from kvpool.pool.client import PoolClient

    with PoolClient(pool) as client:
        client.remove_batch([key for key, _ in client.cache.chunks()])
        client.cache.wait_until(lambda c: c.chunk_count() == 0, timeout_s=60)


#: every layer, in the table's order: its module in ``kvpool.bench.serving`` and its factory there (a peer's module
#: is imported only when its layer runs, so a missing peer fails its own rows)
LAYERS = {
    "none": ("layers", "none"),
    "lmcache": ("lmcache", "layer"),
    "lmcache-fs": ("lmcache", "shared_layer"),
    "mooncake": ("mooncake", "layer"),
    "kvpool": ("layers", "kvpool"),
}


def factory(name: str) -> Factory:
    """The layer called ``name`` (a key of ``LAYERS``)."""
    import importlib

    module, attr = LAYERS[name]
    found: Factory = getattr(importlib.import_module(f"kvpool.bench.serving.{module}"), attr)
    return found
