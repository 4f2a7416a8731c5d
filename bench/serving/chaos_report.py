"""The chaos bench's rows (``bench/chaos.py``): each run's answers against the reference run's, and its table."""

from collections import Counter
from typing import Any

from rich.table import Table

from kvpool.bench.serving.client import FAILED, LOGPROB_OFF, TIE, WRONG_TOKEN, Answer, compare

RECOVERED = 1.5  #: TTFT within this factor of the reference's counts as recovered


def recovery_s(answers: list[Answer], reference: list[Answer], ended_at: float) -> float | None:
    """From ``ended_at`` to the first token of the first request sent after it whose TTFT is within ``RECOVERED``
    times the same request's in the reference (None: no such request)."""
    after = sorted(((a.sent_at, i) for i, a in enumerate(answers) if a.sent_at >= ended_at))
    for sent_at, i in after:
        a, r = answers[i], reference[i]
        if a.ok and r.ok and a.ttft_s <= RECOVERED * r.ttft_s:
            return sent_at + a.ttft_s - ended_at
    return None


def drift(got: Answer, want: Answer) -> float:
    """The largest log-probability difference over the tokens two answers agree on, up to the first that differs."""
    out = 0.0
    for a, b, lp_a, lp_b in zip(got.tokens, want.tokens, got.logprobs, want.logprobs, strict=False):
        if a != b:
            break
        out = max(out, abs(lp_a - lp_b))
    return out


def row(kind: str, answers: list[Answer], pooled: float, ref: list[Answer], tolerance: float) -> dict[str, Any]:
    """One run's row against the reference's answers ``ref`` (its TTFT quantiles are the caller's to add)."""
    verdicts = [compare(a, r, tolerance) if r.ok else FAILED for a, r in zip(answers, ref, strict=True)]
    failed = [a for a in answers if not a.ok]
    return {
        "fault": kind,
        "requests": len(answers),
        "verdicts": dict(Counter(verdicts)),
        "wrong_tokens": verdicts.count(WRONG_TOKEN),
        "logprobs_off": verdicts.count(LOGPROB_OFF),
        "max_logprob_drift": max((drift(a, r) for a, r in zip(answers, ref, strict=True) if a.ok), default=0.0),
        "failed": len(failed),
        "statuses": dict(Counter("cut" if a.status == 200 else str(a.status or "none") for a in failed)),
        "errors": sorted({a.error[:160] for a in failed})[:3],
        "pool_tokens": pooled,
        "ttfts_s": [a.ttft_s for a in answers],
        "mismatches": [
            {"request": i, "verdict": v, "tokens": a.tokens, "logprobs": a.logprobs, "reference": r.tokens}
            | {"reference_logprobs": r.logprobs, "reference_runner_up": r.runner_up}
            for i, (v, a, r) in enumerate(zip(verdicts, answers, ref, strict=True))
            if v in (WRONG_TOKEN, LOGPROB_OFF, TIE)
        ],
    }


def seen(counters: dict[str, float]) -> str:
    """The engines' kvpool fault counters a run moved, short: ``vllm:kvpool_transfer_faults_total{late}`` as
    ``late``, ``vllm:kvpool_misses_total{evicted}`` as ``miss evicted``, ``vllm:kvpool_errors_total{save}`` as
    ``save errors``, Mooncake Store's ``vllm:mooncake_store_operation_failed_keys_total{get}`` as ``get keys failed``
    ("none": none moved)."""
    said = []
    for name, n in sorted(counters.items()):
        metric, _, label = name.partition("{")
        label = label.rstrip("}")
        shown = {
            "vllm:kvpool_misses_total": f"miss {label}",
            "vllm:kvpool_errors_total": f"{label} errors",
            "vllm:mooncake_store_operation_failed_keys_total": f"{label} keys failed",
        }
        said.append(f"{shown.get(metric, label)} {n:.0f}")
    return ", ".join(said) or "none"


def beyond(counters: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    """The counters a run moved more than the reference run did (what its fault added; the rest every run moves, as
    the misses of chunks the run's reset removed)."""
    return {k: n - reference.get(k, 0.0) for k, n in counters.items() if n > reference.get(k, 0.0)}


def table(out: dict[str, Any]) -> Table:
    s, ref = out["scale"], out["rows"][0]
    t = Table(
        title=f"Faults while serving: {s['sent']} requests of the {s['trace']} trace over {out['seconds']:.0f} s, "
        f"through {s['engines']} vLLM engines ({s['model']}; own prefix caches {out['own_cache']}) on {out.get('layer', 'kvpool')} behind "
        f"kvpool route (round-robin); each answer against the no-fault run's, log-probabilities within "
        f"{out['tolerance']:g}; faults held {out['hold_s']:g} s"
    )
    cols = ("fault", "requests", "wrong tokens", "logprobs off", "failed", "TTFT p50", "TTFT p99", "pool tokens")
    for col in (*cols, "recovery", "in the metrics", "what"):
        t.add_column(col, justify="left" if col in ("fault", "what") else "right", overflow="fold")
    for r in out["rows"]:
        if "skipped" in r:
            t.add_row(r["fault"], *[""] * (len(cols) - 1), "", "", f"[yellow]not run: {r['skipped']}[/yellow]")
            continue
        rec = r.get("recovery_s", "")
        statuses = ", ".join(f"{n}x {s}" for s, n in r["statuses"].items())
        t.add_row(
            r["fault"],
            str(r["requests"]),
            f"[red]{r['wrong_tokens']}[/red]" if r["wrong_tokens"] else "0",
            f"{r['logprobs_off']} (max {r['max_logprob_drift']:.1e})",
            f"{r['failed']} ({statuses})" if r["failed"] else "0",
            f"{r.get('p50_ttft_ms', 0):.0f} ms (ref {ref.get('p50_ttft_ms', 0):.0f})",
            f"{r.get('p99_ttft_ms', 0):.0f} ms (ref {ref.get('p99_ttft_ms', 0):.0f})",
            f"{r['pool_tokens']:.0f} (ref {ref['pool_tokens']:.0f})",
            "" if rec == "" else "n/a" if rec is None else f"{rec:.1f} s",
            seen(r.get("metrics", {}) if r is ref else beyond(r.get("metrics", {}), ref.get("metrics", {}))),
            r.get("what", "") + (f"; [red]{r['error']}[/red]" if r.get("error") else ""),
        )
    t.caption = (
        f"wrong tokens: a token that differs from the reference's where its top two were more than {out['tolerance']:g}"
        f" apart (a closer pair is a tie: {sum(r.get('verdicts', {}).get(TIE, 0) for r in out['rows'])} here); "
        "logprobs off: the same tokens, a log-probability further off (max: the largest drift seen); failed: no "
        "complete answer (HTTP status; cut: the stream broke off); pool tokens: prompt tokens the engines took from "
        "the layer below (their /metrics); recovery: from the fault's end to the first token of the first request sent after "
        f"it with TTFT within {RECOVERED:g}x of the same request's in the reference (n/a: none); in the metrics: what "
        "the run moved of the engines' vllm:kvpool_transfer_faults_total{kind}, vllm:kvpool_misses_total{cause} "
        "(miss ...) and vllm:kvpool_errors_total{direction} (load / save errors) — under Mooncake Store "
        "vllm:mooncake_store_operation_failed_keys_total{operation} (... keys failed) —, summed over the engines that answer "
        "after the run, beyond what the reference run moved (each run empties the pool first, so its first lookups find "
        "chunks 'removed'); counted in the engines, so a pool node killed takes none with it."
    )
    return t
