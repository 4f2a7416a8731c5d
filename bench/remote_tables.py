"""The tables of ``bench/remote.py``: S3 requests (RemoteStore beside boto3) and KV through codecs, beside the
limits measured in the same run."""

from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool.bench.remote_requests import KiB
from kvpool.pool.config import MiB

console = Console(width=170)


def size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size % MiB == 0 else f"{size // KiB} KiB"


Index = dict[tuple[str, str, int, int], dict[str, Any]]  #: request rows by (op, client, size, threads)


def render(results: dict[str, Any]) -> None:
    index = {(r["op"], r["client"], r["size"], r["threads"]): r for r in results["requests"]}
    render_requests(results, index)
    if results["codecs"]:
        render_codecs(results, index)


def render_requests(results: dict[str, Any], index: Index) -> None:
    """A table per op: RemoteStore beside boto3, a row per chunk size and number of threads."""
    tcp = {lim["size"]: lim["tcp_gbps"] for lim in results["limits"]["tcp"]}
    memcpy = results["limits"]["memcpy_gbps"]
    rows = results["requests"]
    per_cell = results["settings"]["bytes_per_cell"] // MiB
    console.print(f"[bold]S3[/]: {results['server']['server']}, {results['server']['endpoint']}")
    for op in ("put", "get"):
        table = Table(title=f"remote tier {op}: RemoteStore vs raw boto3 on the same server ({per_cell} MiB per cell)")
        cols = (
            "chunk x requests",
            "threads",
            "RemoteStore GB/s",
            "req/s",
            "p50 ms",
            "p99 ms",
            "boto3 GB/s",
            "req/s ",
            "p50 ms ",
            "p99 ms ",
            "vs boto3",
            "TCP loopback GB/s",
            "memcpy GB/s",
        )
        for col in cols:
            table.add_column(col, justify="left" if col == "chunk x requests" else "right")
        sizes = sorted({r["size"] for r in rows})
        for size in sizes:
            threads = sorted({r["threads"] for r in rows if r["size"] == size})
            for t in threads:
                s, b = index[(op, "RemoteStore", size, t)], index[(op, "boto3", size, t)]
                table.add_row(
                    f"{size_label(size)} x {s['requests']}",
                    str(t),
                    f"{s['gbps']:.3f}",
                    f"{s['ops_per_s']:.0f}",
                    f"{s['p50_ms']:.1f}",
                    f"{s['p99_ms']:.1f}",
                    f"{b['gbps']:.3f}",
                    f"{b['ops_per_s']:.0f}",
                    f"{b['p50_ms']:.1f}",
                    f"{b['p99_ms']:.1f}",
                    f"{s['gbps'] / b['gbps'] - 1:+.0%}",
                    f"{tcp[size]:.2f}",
                    f"{memcpy:.2f}",
                    end_section=t == threads[-1] and size != sizes[-1],
                )
        console.print(table)
    console.print(
        "GB/s: bytes of the chunks as stored per second (all threads together); req/s: requests per second; p50/p99: "
        "latency of one request (with under 100 requests in a cell, p99 is about the slowest); vs boto3: RemoteStore "
        "GB/s over boto3's, minus 1.  Limits, same run: TCP loopback = one stream sending chunk-sized blocks; "
        f"memcpy = one thread copying {results['limits']['memcpy_bytes'] // MiB} MiB."
    )


def render_codecs(results: dict[str, Any], index: Index) -> None:
    """KV through the tier: a row per codec and number of threads, beside the raw rows and the limits."""
    tcp = {lim["size"]: lim["tcp_gbps"] for lim in results["limits"]["tcp"]}
    memcpy = results["limits"]["memcpy_gbps"]
    per_cell = results["settings"]["bytes_per_cell"] // MiB
    s = results["settings"]
    kv = s["kv_chunk_bytes"]
    table = Table(
        title=f"KV through the remote tier: {size_label(kv)} float32 torch.randn chunks {s['kv_shape']}, "
        f"{per_cell} MiB of KV per cell; GB/s of KV delivered"
    )
    kv_cols = (
        "codec",
        "threads",
        "ratio",
        "encode+put GB/s",
        "p50/p99 ms",
        "get+decode GB/s",
        "p50/p99 ms ",
        "stored GB/s put / get",
        "codec alone enc / dec GB/s",
        "KV rel err",
        f"raw {size_label(kv)} put / get GB/s",
        "TCP / memcpy GB/s",
    )
    for col in kv_cols:
        table.add_column(col, justify="left" if col == "codec" else "right")
    codecs = list(dict.fromkeys(r["codec"] for r in results["codecs"]))
    for r in results["codecs"]:
        put, get = (
            index.get(("put", "RemoteStore", kv, r["threads"])),
            index.get(("get", "RemoteStore", kv, r["threads"])),
        )
        table.add_row(
            r["codec"],
            str(r["threads"]),
            f"{r['ratio']:.2f}x",
            f"{r['put_kv_gbps']:.3f}",
            f"{r['put_p50_ms']:.1f} / {r['put_p99_ms']:.1f}",
            f"{r['get_kv_gbps']:.3f}",
            f"{r['get_p50_ms']:.1f} / {r['get_p99_ms']:.1f}",
            f"{r['put_stored_gbps']:.3f} / {r['get_stored_gbps']:.3f}",
            f"{r['encode_gbps']:.2f} / {r['decode_gbps']:.2f}",
            f"{r['kv_rel_err']:.4f}",
            f"{put['gbps']:.3f} / {get['gbps']:.3f}" if put and get else "-",
            f"{tcp[kv]:.2f} / {memcpy:.2f}",
            end_section=r["threads"] == s["threads"][-1] and r["codec"] != codecs[-1],
        )
    console.print(table)
    console.print(
        "ratio: KV bytes / bytes stored (headers included); encode+put, get+decode: float32 KV bytes per second "
        "through the tier (all threads); stored GB/s: the object bytes those moved; raw put / get: the RemoteStore "
        "rows above (same chunk size and threads, no codec), the tier's speed for opaque bytes; codec alone: encode "
        "and decode on one thread, no I/O; KV rel err: ||read back - original|| / ||original|| of one chunk; TCP: "
        "the limit at this chunk size; memcpy: as above."
    )
