"""Starting and stopping the pool's ``PoolNode`` actors: one per Ray node, named ``kvpool-node-<ray node id>`` in the
pool's Ray namespace, detached, pinned to its node with ``NodeAffinitySchedulingStrategy``, several calls at once."""

import logging
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.pool.config import PoolConfig
from kvpool.pool.node.node import PoolNode
from kvpool.pool.protocol import actor_name

log = logging.getLogger(__name__)
NODE_CALLS = 8  #: calls the actor runs at once


def start_pool(config: PoolConfig, node_ids: Sequence[str] | None = None) -> dict[str, Any]:
    """One ``PoolNode`` actor on each alive Ray node (or on ``node_ids``); returns ``node id → handle``.

    Already running actors are reused (``get_if_exists``), so calling it twice is harmless.
    """
    ids = list(node_ids) if node_ids is not None else [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    actor_cls = ray.remote(num_cpus=0, max_restarts=0)(PoolNode)
    handles: dict[str, Any] = {
        nid: actor_cls.options(
            name=actor_name(nid),
            namespace=config.namespace,
            lifetime="detached",
            get_if_exists=True,
            max_concurrency=NODE_CALLS,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
        ).remote(config, nid)
        for nid in ids
    }
    ray.get([h.info.remote() for h in handles.values()])  # constructed, registered, serving
    return handles


def stop_pool(config: PoolConfig) -> int:
    """Shut every PoolNode of ``config.namespace`` down and remove the actors; returns how many there were."""
    stopped = 0
    for n in ray.nodes():
        try:
            handle = ray.get_actor(actor_name(n["NodeID"]), namespace=config.namespace)
        except ValueError:
            continue
        try:
            ray.get(handle.shutdown.remote(), timeout=30)
        except Exception as exc:  # a dead actor: its lease expires on its own
            log.warning("pool node %s did not shut down cleanly: %s", n["NodeID"], exc)
        ray.kill(handle)
        stopped += 1
    return stopped
