"""``kvpool events``: the pool's chunk events (stored, removed, moved between tiers) as they happen, as text or
JSON lines, and optionally as vLLM-style KV events on ZeroMQ for outside routers (docs/routing.md)."""

import contextlib
import json
import uuid

import typer

from kvpool.cli import options, root
from kvpool.core.config import Rule, obey
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.events import ChunkEvent, EventStream
from kvpool.metadata.namespace import Namespace

_REPLAY = (Rule("needs", "--zmq-replay", "--zmq", "give --zmq, the PUB socket the replayed batches belong to"),)


def _line(e: ChunkEvent) -> str:
    """Revision, kind, key, node, cache identity's fingerprint ("-": none), tier (and the one it left), bytes."""
    where = f"{e.tier.value if e.tier else '?'}" + (f" (from {e.was.value})" if e.was else "")
    head = f"{e.revision:>8}  {e.kind.value:<7}  {e.key.hex()[:16]}  {e.node[:12]:<12}  {e.identity or '-':<16}"
    return f"{head}  {where}  {e.size} B"


@root.app.command("events")
def events(
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    after: int = typer.Option(
        -1,
        "--after",
        min=-1,
        show_default=False,
        help="Resume after this etcd revision (the last one a consumer saw): every change since, none twice. "
        "Default: start with the pool's contents as 'stored' events at the current revision.",
    ),
    follow: bool = typer.Option(
        True, "--follow/--no-follow", help="Keep printing changes as they happen; --no-follow stops at the present."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per event (kind, revision, key, node, tier, size, identity, was)."
    ),
    zmq_endpoint: str = typer.Option(
        "",
        "--zmq",
        show_default=False,
        help="Also publish vLLM-style KV events (msgpack over a ZeroMQ PUB socket) here, e.g. tcp://127.0.0.1:5557.",
    ),
    zmq_replay: str = typer.Option(
        "",
        "--zmq-replay",
        show_default=False,
        help="ROUTER socket answering 'send me the batches from sequence N on', e.g. tcp://127.0.0.1:5558.",
    ),
) -> None:
    """Tail the pool's chunk events, derived from etcd's watch of the placements: nothing is missed, and a
    consumer that remembers the last revision resumes after it (--after) with no gap and no repeat."""
    with root.errors():
        obey(_REPLAY, {"--zmq-replay": zmq_replay, "--zmq": zmq_endpoint})
        config = options.pool_etcd(etcd, cluster, "events")
        client = EtcdClient(config)
        ns = Namespace(config.cluster)
        with contextlib.ExitStack() as stack:
            stack.callback(client.close)
            publisher = None
            if zmq_endpoint:
                from kvpool.metadata.zmq_events import ZmqPublisher, vllm_batch

                publisher = ZmqPublisher(zmq_endpoint, zmq_replay)
                stack.callback(publisher.close)
            until = None if follow else client.put(ns.sync_marker, uuid.uuid4().bytes)
            stream = EventStream(client, ns, after=None if after < 0 else after, until=until)
            first = after < 0
            with contextlib.suppress(KeyboardInterrupt):
                for _, batch in stream:
                    for e in batch:
                        if as_json:
                            print(json.dumps(e.as_json()), flush=True)
                        else:
                            root.console.print(_line(e), highlight=False, soft_wrap=True)
                    if publisher is not None and (batch or first):
                        publisher.publish(vllm_batch(batch, cleared=first))
                    first = False
