"""The serving bench's rows, table, JSON and TTFT CDF."""

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(width=170)
#: what a run keeps of ``vllm bench serve``'s result
KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "request_throughput", "output_throughput")


def run(result: dict[str, Any]) -> dict[str, Any]:
    """One run's row fields from ``vllm bench serve``'s result (with the harness's token counts)."""
    out = {k: result.get(k) for k in KEYS}
    out.update(completed=result.get("completed", 0), failed=result.get("failed", 0), tokens=result["tokens"])
    out["connector"] = result.get("connector", {})  #: kvpool's connector: seconds and errors loading / saving
    out["phases_s"] = result.get("phases_s", {})  #: the requests' seconds queued / in prefill / in decode
    out["router"] = result.get("router", {})  #: prompt blocks, those its pick held, the engines' KV events followed
    out["ttfts_s"] = result.get("ttfts", [])
    out["errors"] = sorted({e for e in result.get("errors", []) if e})[:5]
    if "fresh_tokens" in result:
        out["fresh_tokens"] = result["fresh_tokens"]
    return out


def scale(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How the trace was scaled, and what it then holds."""
    keep = ["trace", "sample", "requests", "hash_block", "max_input", "max_output", "speedup", "engines"]
    keep += ["engine_blocks", "pool_mib", "kvpool_chunk", "kvpool_layerwise", "dtype", "bind_cores"]
    ids = [h for r in rows for h in r["hash_ids"]]
    return {
        **{k: getattr(args, k) for k in keep},
        "model": Path(args.model_dir).name,
        "sent": len(rows),
        "block_reuse": 1 - len(set(ids)) / len(ids) if ids else 0.0,
        "seconds": (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0,  # the trace's ms, scaled
    }


def shares(tokens: dict[str, float]) -> tuple[str, str]:
    """The prompt tokens' shares from the engine's own cache and from the layer below."""
    total = sum(tokens.values()) or 1.0
    return f"{tokens['own cache'] / total:.0%}", f"{tokens['layer below'] / total:.0%}"


def progress(r: dict[str, Any]) -> None:
    """One line as each run ends."""
    if "error" in r:
        console.print(f"  {r['layer']}: [red]not run[/red]: {r['error']}")
        return
    own, below = shares(r["tokens"])
    console.print(
        f"  {r['layer']}, {r['route']}: TTFT p50 {r['p50_ttft_ms']:.0f} ms, p99 {r['p99_ttft_ms']:.0f} ms; "
        f"{r['request_throughput']:.2f} req/s; prompt tokens from own cache {own}, layer below {below}; "
        f"{r['completed']} done, {r['failed']} failed"
        + "".join(f"; {k} {v:.0f} s" for k, v in r.get("phases_s", {}).items())
        + "".join(
            f"; connector {k[:-2]} {v:.1f} s" if k.endswith("_s") else f"; connector {k.replace('_', ' ')} {v:.0f}"
            for k, v in r.get("connector", {}).items()
            if v
        )
        + (
            f"; router: {routed['matched_blocks']:.0f} of {routed['prompt_blocks']:.0f} prompt blocks held where sent"
            f" ({routed['kv_events']:.0f} KV events)"
            if (routed := r.get("router", {})).get("prompt_blocks")
            else ""
        )
    )


def table(out: dict[str, Any]) -> Table:
    s = out["scale"]
    t = Table(
        title=f"{s['trace']} trace: 1 conversation in {s['sample']}, its first {s['sent']} requests ({s['block_reuse']:.0%}"
        f" of blocks repeated, {s['seconds']:.0f} s after / {s['speedup']:g}), through {s['engines']} vLLM engines behind "
        f"kvpool route ({s['model']} in {s['dtype']}{', an engine a core' if s['bind_cores'] else ''}; a hash id = {s['hash_block']} tokens, inputs <= {s['max_input']}, outputs "
        f"{s['max_output']}; {s['engine_blocks']} KV blocks of 32 tokens an engine, {s['pool_mib']} MiB of layer an engine; kvpool chunks of {s['kvpool_chunk']} tokens"
        f"{'' if s.get('kvpool_layerwise', True) else ', loaded before the forward'})"
    )
    cols = ("layer", "route", "TTFT p50", "p90", "p99", "TPOT p50", "req/s", "out tok/s", "own cache", "layer below")
    for col in (*cols, "failed"):
        t.add_column(col, justify="left" if col in ("layer", "route") else "right")
    for r in out["rows"]:
        if "error" in r:
            t.add_row(r["layer"], "-", f"[red]not run: {r['error'][:120]}[/red]", *[""] * (len(cols) - 2))
            continue
        own, below = shares(r["tokens"])
        ms = [f"{r[k]:.0f} ms" for k in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms")]
        t.add_row(
            r["layer"],
            r["route"],
            *ms,
            f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:.1f}",
            own,
            below,
            str(r["failed"]),
        )
        if r["route"] == "restart":
            steady = r.get("steady", {})
            fresh_own, fresh_below = shares(r["fresh_tokens"])
            t.add_row(
                "",
                "  steady",
                f"{steady.get('p50_ttft_ms', 0):.0f} ms",
                "",
                f"{steady.get('p99_ttft_ms', 0):.0f} ms",
                "",
                "",
                "",
                f"fresh: {fresh_own}",
                f"fresh: {fresh_below}",
                "",
            )
    notes = sorted({r["note"] for r in out["rows"] if r.get("note")})
    t.caption = (
        "own cache / layer below: of the prompt tokens, those vLLM took from its own prefix cache / from the KV-cache "
        "layer (its /metrics). restart: the trace's second half after engine 0 was replaced by a fresh one; steady: the "
        "same requests in the round-robin run; fresh: the fresh engine's own tokens. "
        + "".join(f"{n}. " for n in notes)
    )
    return t


def plot(out: dict[str, Any], path: Path) -> None:
    """TTFT CDF of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in out["rows"]:
        ttfts = sorted(t for t in r.get("ttfts_s", []) if t > 0)
        if ttfts and r["route"] != "restart":
            ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=f"{r['layer']}, {r['route']}")
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="requests", title="TTFT per KV-cache layer and route")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def save(out: dict[str, Any], path: Path) -> None:
    """The rows so far as JSON at ``path`` (after each layer: a run cut short keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


def write(out: dict[str, Any], path: Path) -> None:
    """The table on the console, the rows as JSON at ``path`` and the CDF as PNG beside it."""
    save(out, path)
    plot(out, path.with_suffix(".png"))
    console.print(table(out))
    console.print(f"written {path} and {path.with_suffix('.png')}")
