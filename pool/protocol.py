"""How a client reaches a ``PoolNode`` actor: its name, what its calls return, and one translation of Ray's errors.

A node's own refusal (a :class:`~kvpool.errors.KvPoolError` raised inside the actor) comes back as itself; a node
that is dead, stopped, or does not answer within the timeout is :class:`~kvpool.errors.NodeUnreachable`.  Nothing
else in the client catches a Ray exception.
"""

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from kvpool.errors import ChunkBusy, KvPoolError, NodeUnreachable
from kvpool.pool.chunks import short

CALL_TIMEOUT_S = 60.0  #: a node call that has not answered by then counts as the node being unreachable


def actor_name(node_id: str) -> str:
    return f"kvpool-node-{node_id}"


@dataclass(frozen=True)
class NodeInfo:
    """What a node tells a client on the same Ray node, so the client can map its segments."""

    node_id: str
    dram_path: str  #: the shared-memory file a same-node client maps
    dram_capacity: int
    nvme_capacity: int
    nvme_direct: bool  #: O_DIRECT in use on the NVMe segment
    nvme_path: str  #: the NVMe segment's file ("" without one), which a same-node client reads into device memory
    metrics_address: str  #: host:port of its Prometheus endpoint ("" if off)
    restart: str = ""  #: what it took back of its last run's NVMe chunks (warm restart; "" if nothing was there)


@dataclass(frozen=True)
class Settled:
    """What a batch of moves or removes left behind: the etcd revision that shows it, and the keys left as
    they were because a reader had them pinned (the caller waits for the read and asks again)."""

    revision: int
    busy: list[bytes]


def call(ref: Any, timeout_s: float | None = CALL_TIMEOUT_S) -> Any:
    """The result of a node call (``ray.get``): the node's own kvpool error re-raised as itself, a dead or
    silent node as ``NodeUnreachable``."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, KvPoolError):
            raise exc.cause from None
        raise
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        raise NodeUnreachable(f"pool node unreachable ({type(exc).__name__}): it died or is overloaded") from exc


class NodeHandles:
    """The actor handles of the pool's nodes in one Ray namespace, looked up once each."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._handles: dict[str, Any] = {}

    def __getitem__(self, node_id: str) -> Any:
        if node_id not in self._handles:
            try:
                self._handles[node_id] = ray.get_actor(actor_name(node_id), namespace=self.namespace)
            except ValueError:  # Ray's way of saying there is no such actor
                raise NodeUnreachable(
                    f"no pool node actor for node {node_id[:12]} (it died or was stopped): see kvpool status"
                ) from None
        return self._handles[node_id]

    def settle(self, by_node: dict[str, list[bytes]], change: Callable[[Any, list[bytes]], Any], wait_s: float) -> int:
        """``change(actor, its keys)`` once per node of ``by_node`` (a node gone meanwhile is skipped); the etcd
        revision that shows what the calls changed.

        A node leaves a chunk that a reader has pinned as it is and names it (:class:`Settled`); those keys are
        asked again, with back-off (5 ms doubling to 0.5 s), until ``wait_s`` has passed — then ``ChunkBusy``.
        Reads hold their pins only for one transfer, and a client's own releases always reach a node before its
        next call there (Ray runs one caller's calls to an actor in order), so the wait is for *other* clients'
        reads: one that released its pins without waiting, or one still in flight."""
        revision, pause = 0, 0.005
        deadline = time.monotonic() + wait_s
        while by_node:
            busy: dict[str, list[bytes]] = {}
            for node_id, node_keys in by_node.items():
                with contextlib.suppress(NodeUnreachable):
                    settled: Settled = call(change(self[node_id], node_keys))
                    revision = max(revision, settled.revision)
                    if settled.busy:
                        busy[node_id] = settled.busy
            by_node = busy
            if by_node and time.monotonic() + pause > deadline:
                left = [k for ks in by_node.values() for k in ks]
                raise ChunkBusy(
                    f"{len(left)} chunks (first {short(left[0])}) were still being read after {wait_s:g} s "
                    "(busy_wait_s): retry once those reads end; the rest are done"
                )
            if by_node:
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        return revision
