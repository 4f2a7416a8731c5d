"""bench/sglang.py's report: each row's figures beside its memcpy, the pages-per-object comparison, the issue's goals
against the run, and the table."""

import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool.pool.config import MiB

console = Console(width=160)


def figures(row: dict[str, Any], nbytes: int, memcpy: float) -> dict[str, Any]:
    """GB/s (median pass) and the ratio to memcpy of each timed step of a row; batch_exists in ms."""
    out: dict[str, Any] = {k: v for k, v in row.items() if not k.endswith("_s")}
    if row.get("memcpy_s"):  # the memcpy beside this row's passes
        memcpy = out["memcpy_gbps"] = nbytes / statistics.median(row["memcpy_s"]) / 1e9
    for step in ("save", "load", "backup", "prefetch"):
        if samples := row.get(f"{step}_s"):
            gbps = nbytes / statistics.median(samples) / 1e9
            out[step] = {
                "gbps": gbps,
                "x_memcpy": gbps / memcpy,
                "gbps_range": [nbytes / max(samples) / 1e9, nbytes / min(samples) / 1e9],
            }
    if "exists_s" in row:
        out["exists_ms"] = row["exists_s"] * 1e3
    return out


def grouping(per: dict[Any, Any], shape: Any) -> dict[str, Any]:
    """GB/s (median pass) of one batch put and got as objects of ``g`` pages, for each ``g`` measured."""
    if "note" in per:
        return per
    out: dict[str, Any] = {}
    for g, row in per.items():
        fig: dict[str, Any] = {"objects": shape.batch // int(g)}
        for step, samples in (("put", row["put_s"]), ("get", row["get_s"]), ("cross_get", row["cross_get_s"])):
            if isinstance(samples, dict) and "s" not in samples:
                fig[step] = samples  # why it was not measured
            elif samples:
                seconds = samples["s"] if isinstance(samples, dict) else samples
                fig[step] = {"gbps": shape.batch_bytes / statistics.median(seconds) / 1e9}
        out[str(g)] = fig
    return out


def goals(rows: dict[str, Any]) -> str:
    """The issue's goals against this run: same-node load >= 0.8x memcpy, >= 1.5x Mooncake's, batch_exists < 1 ms."""

    def load(name: str) -> float | None:
        return rows.get(name, {}).get("load", {}).get("gbps")

    here = rows.get("kvpool, same node", {})
    parts = []
    if "load" in here:
        parts.append(f"kvpool same-node load {here['load']['x_memcpy']:.2f}x memcpy (goal >= 0.8)")
    for where in ("same node", "cross-node"):
        ours, theirs = load(f"kvpool, {where}"), load(f"Mooncake, {where}")
        if ours and theirs:
            parts.append(f"{where} load {ours / theirs:.2f}x Mooncake's (goal >= 1.5)")
    if "exists_ms" in here:
        parts.append(f"batch_exists {here['exists_ms']:.3f} ms (goal < 1)")
    return "goals: " + "; ".join(parts)


def cell(fig: dict[str, Any] | None) -> str:
    if not fig:
        return "—"
    return f"{fig['gbps']:.2f}  [dim]{fig['x_memcpy']:.2f}x[/dim]"


def render(result: dict[str, Any]) -> None:
    shape, memcpy = result["shape"], result["memcpy_gbps"]
    table = Table(
        title=f"SGLang HiCache L3 on CPU: {shape['batch']} pages of {shape['page_bytes'] / MiB:.1f} MiB a batch "
        f"({shape['layout']}), GB/s (median of {result['repeat']}) and x memcpy",
        caption="backend: the calls the controller makes for one batch; controller: write_storage → backup ack, "
        "prefetch → hit query → last ack (its threads)\nkvpool cross-node: a storage side on the other Ray node loads "
        "what the first saved (a save lands on the saver's own node first)",
    )
    cols = (
        "backend",
        "memcpy beside",
        "save",
        "batch_exists",
        "load",
        "controller backup",
        "controller prefetch",
        "note",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("backend", "note") else "right")
    table.add_row("memcpy at the start (np.copyto)", f"{memcpy:.2f}", "", "", "", "", "", "a batch's bytes in one copy")
    for name, row in result["rows"].items():
        ms = f"{row['exists_ms']:.3f} ms" if "exists_ms" in row else "—"
        note = row.get("note", "")
        if placed := row.get("placed_on"):
            note = f"objects on {', '.join(placed)}"
        table.add_row(
            name,
            f"{row['memcpy_gbps']:.2f}" if "memcpy_gbps" in row else "",
            cell(row.get("save")),
            ms,
            cell(row.get("load")),
            cell(row.get("backup")),
            cell(row.get("prefetch")),
            note,
        )
    console.print(table)
    console.print(goals(result["rows"]))
    steps = result["load_steps_gbps"]
    console.print(
        "a same-node load's steps alone, one batch, GB/s: "
        + ", ".join(f"{name} {gbps:.2f} ({gbps / memcpy:.2f}x)" for name, gbps in steps.items())
        + "\n(straight into host slots: copy_checked; through staging: copy_checked + copy into page views)"
    )
    groups = Table(title="Pages per pool object: one batch through the pool client (put_batch / get_into_batch), GB/s")
    for col in ("pages an object", "objects", "put, same node", "get, same node", "get, cross-node"):
        groups.add_column(col, justify="right")
    for g, fig in result["pages_per_object"].items():
        if g == "note":
            groups.add_row("—", "", fig[:60], "", "")
            continue
        cells = [
            f"{fig[k]['gbps']:.2f}" if "gbps" in fig.get(k, {}) else fig.get(k, {}).get("note", "—")[:40]
            for k in ("put", "get", "cross_get")
        ]
        groups.add_row(g, str(fig["objects"]), *cells)
    console.print(groups)
