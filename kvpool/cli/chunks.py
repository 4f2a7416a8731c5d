"""The chunks of a running pool: ``kvpool ls`` lists them, ``put`` stores a file as one, ``get`` reads one back."""

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

import typer
from rich.table import Table

from kvpool.cli import connect, options, root
from kvpool.core.keys import parse_key
from kvpool.core.types import Placement
from kvpool.errors import ConfigError

Chunk = tuple[bytes, Sequence[Placement]]  #: a key and its replicas


def chunks_table(chunks: Sequence[Chunk], title: str, limit: int) -> Table:
    """The first ``limit`` of ``chunks`` by key: key prefix, stored bytes, each replica's node, tier and offset, codec,
    crc32c, and the fingerprint of the cache identity it was put under ("-": none given)."""
    table = Table(title=title)
    for col in ("key", "stored bytes", "replicas (node: tier @ offset)", "codec", "crc32c", "identity"):
        table.add_column(col, justify="right" if col == "stored bytes" else "left")
    for key, replicas in sorted(chunks, key=lambda c: c[0])[:limit]:
        where = ", ".join(f"{p.node[:12]}: {p.tier.value} @ {p.offset}" for p in replicas)
        first = replicas[0]
        table.add_row(
            key.hex()[:16], str(first.stored), where, first.codec, f"{first.checksum:08x}", first.identity or "-"
        )
    return table


def where(replicas: Sequence[Placement]) -> str:
    """``node (tier)`` of each replica."""
    return ", ".join(f"{p.node[:12]} ({p.tier.value})" for p in replicas)


@root.app.command("ls")
def list_chunks(
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    node: str = typer.Option(
        "", "--node", help="Only chunks with a replica on this node (id or prefix).", show_default=False
    ),
    limit: int = typer.Option(50, "--limit", min=1, help="Show at most this many chunks."),
) -> None:
    """List chunks of a running pool: key, size, where each replica lives (node, tier, offset), codec, checksum and
    cache identity."""
    with root.errors():
        with connect.running_cache(etcd, cluster, "ls") as cache:
            rows = [(k, r) for k, r in cache.chunks() if not node or any(p.node.startswith(node) for p in r)]
        title = f"{len(rows)} chunks in cluster '{cluster}'" + (f" on node {node}" if node else "")
        root.console.print(chunks_table(rows, title, limit))
        if len(rows) > limit:
            root.console.print(f"... and {len(rows) - limit} more (--limit)")


@root.app.command()
def put(
    path: Path = typer.Argument(..., exists=True, dir_okay=False, help="File whose bytes become one chunk."),
    key: str = typer.Option("", "--key", help="The chunk key, 64 hex digits. Default: SHA-256 of the bytes."),
    replicas: int = options.REPLICAS,
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    ray_address: str = options.RAY_ADDRESS,
    namespace: str = options.NAMESPACE,
) -> None:
    """Put a file's bytes into a running pool as one chunk (for inspection and tests), and print its key."""
    with root.errors():
        data = path.read_bytes()
        if not data:
            raise ConfigError(f"{path} is empty: a chunk holds at least one byte")
        chunk_key = parse_key(key, "--key") if key else hashlib.sha256(data).digest()
        with connect.attached_client("put", etcd, cluster, ray_address, namespace) as client:
            client.put_batch([(chunk_key, data)], replicas=replicas)
            held = where(client.cache.replicas(chunk_key))
        root.console.print(f"{chunk_key.hex()}  {len(data)} bytes on {held}", soft_wrap=True)


@root.app.command()
def get(
    key: str = typer.Argument(..., help="The chunk key, 64 hex digits (kvpool ls shows them)."),
    out: Path | None = typer.Option(
        None, "--out", dir_okay=False, help="Write the bytes here. Default: just check them."
    ),
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    ray_address: str = options.RAY_ADDRESS,
    namespace: str = options.NAMESPACE,
) -> None:
    """Read one chunk from a running pool, checksum verified; say where it came from; optionally save it."""
    with root.errors():
        chunk_key = parse_key(key)
        with connect.attached_client("get", etcd, cluster, ray_address, namespace) as client:
            held = where(client.cache.replicas(chunk_key))
            t0 = time.perf_counter()
            data = client.get(chunk_key)
            took = time.perf_counter() - t0
        if out is not None:
            out.write_bytes(data)
        saved = f"; written to {out}" if out is not None else ""
        root.console.print(
            f"{chunk_key.hex()}  {len(data)} bytes, crc32c verified, in {took * 1e3:.1f} ms; replicas: {held}{saved}",
            soft_wrap=True,
        )
