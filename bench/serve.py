"""A Mooncake trace served through real vLLM engines behind one router, per KV-cache layer and routing policy, replayed
by vLLM's own ``vllm bench serve`` (``--dataset-name timed_trace``): how users choose a KV-cache layer.

For each layer (``none``: vLLM's own prefix cache alone; ``lmcache``: LMCache's local CPU cache in each engine;
``lmcache-fs``: LMCache with a remote backend the engines share; ``mooncake``: Mooncake Store through vLLM's
``MooncakeStoreConnector``; ``kvpool``: a local pool, one Ray node per engine), ``--engines`` vLLM OpenAI servers run
on 127.0.0.2 and up, each with a small KV cache of its own (``--engine-blocks``), so that its prefix cache evicts and
the layer below it matters; for each policy ``kvpool route`` (round-robin, least-loaded, prefix-aware: from the
engines' own KV events, which every engine then publishes) goes in front of them, the engines' prefix caches and the
layer emptied first.  Per run: TTFT p50 / p90 / p99, TPOT, requests/s
and output tokens/s from ``vllm bench serve``'s own result, and the prompt tokens the engines took from their own
cache and from the layer below (their ``/metrics``).  Then one operational scenario per layer, ``restart``: the first
half of the trace served round-robin, engine 0 replaced by a fresh one, the second half served: its TTFT against the
same requests in the round-robin run, and where the fresh engine's prompt tokens came from.  The peers need
``make bench-peers`` first; a layer that cannot start is a row that says why.

The trace is scaled to this machine, and the table says how: one conversation in ``--sample`` (those whose second
block's hash id is a multiple of it: every request of a conversation shares its first blocks, so the sample keeps the
trace's reuse, 37-42 % of blocks, at a rate 2 cores can serve), its first ``--requests`` requests, a hash id expanded
to ``--hash-block`` tokens (512 in the trace), inputs cut to ``--max-input`` tokens, outputs to ``--max-output``
(temperature 0, EOS ignored), time compressed ``--speedup`` times.  ``vllm bench serve`` draws each hash id's tokens
with ``PYTHONHASHSEED=0``, so every run sends the same prompts.

    python bench/serve.py [--layers none,kvpool,...] [--routes round-robin,...] [--requests 30] [--model DIR]
"""

import argparse
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from kvpool.bench.serving import report, window
from kvpool.bench.serving.harness import engine, reset, scaled_trace, served, tokens_by_source, write_trace
from kvpool.bench.serving.layers import LAYERS, Layer, LayerUnavailable, factory
from kvpool.bench.serving.options import names, scale_options
from kvpool.core.net import free_port
from kvpool.errors import KvPoolError

ROUTES = ("round-robin", "least-loaded", "prefix-aware")


def run_layer(name: str, args: argparse.Namespace, rows: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    """Every routing policy over one layer's engines, then its restart scenario: a row each; a layer that cannot
    run, or fails, is one row saying why."""
    out: list[dict[str, Any]] = []
    try:
        with factory(name)(args, work) as layer, ExitStack() as stack:
            shared = None if layer.in_engines else stack.enter_context(fleet(args, layer, work))
            for policy in args.routes:
                with fleet(args, layer, work, policy) if shared is None else nullcontext(shared) as urls:
                    reset(urls)
                    layer.empty()
                    result = served(args, urls, policy, work / "trace.jsonl", work / f"{policy}.json")
                out.append({"layer": name, "route": policy, **report.run(result)})
                report.progress(out[-1])
            if args.restart:
                with fleet(args, layer, work, "restart") if shared is None else nullcontext(shared) as urls:
                    steady = next((r for r in out if r["route"] == "round-robin"), None)
                    out.append({"layer": name, "route": "restart", **restart(args, layer, urls, rows, steady, work)})
                report.progress(out[-1])
            note = layer.note
    except (LayerUnavailable, KvPoolError, OSError) as exc:
        out.append({"layer": name, "route": "-", "error": f"{type(exc).__name__}: {exc}"})
        report.progress(out[-1])
        return out
    return [{**r, "note": note} for r in out]


@contextmanager
def fleet(args: argparse.Namespace, layer: Layer, work: Path, run: str = "all") -> Iterator[list[str]]:
    """``--engines`` engines of the layer; their URLs."""
    with ExitStack() as stack:
        yield [stack.enter_context(engine(args, layer, i, work / f"{run}-engine{i}.log")) for i in range(args.engines)]


def restart(
    args: argparse.Namespace,
    layer: Layer,
    urls: list[str],
    rows: list[dict[str, Any]],
    steady: dict[str, Any] | None,
    work: Path,
) -> dict[str, Any]:
    """The first half of the trace round-robin over ``urls``; then engine 0 replaced by a fresh one (as a restart
    leaves it: its own cache empty) and the second half round-robin over it and the others."""
    half = len(rows) // 2
    reset(urls)
    layer.empty()
    served(args, urls, "round-robin", write_trace(rows[:half], work / "first.jsonl"), work / "first.json")
    with engine(args, layer, args.engines, work / "restart-fresh.log") as fresh:
        second = write_trace(rows[half:], work / "second.jsonl")
        result = served(args, [fresh, *urls[1:]], "round-robin", second, work / "second.json")
        result["fresh_tokens"] = tokens_by_source([fresh])
    out = report.run(result)
    if steady is not None:
        out["steady"] = quantiles(steady["ttfts_s"][half:])
    return out


def quantiles(ttfts: list[float]) -> dict[str, float]:
    """TTFT p50 / p99 in ms of ``ttfts`` (seconds; 0 for failed requests, left out)."""
    done = sorted(t for t in ttfts if t > 0)
    if len(done) < 2:
        return {}
    cuts = statistics.quantiles(done, n=100, method="inclusive")
    return {"p50_ttft_ms": cuts[49] * 1000, "p99_ttft_ms": cuts[98] * 1000}


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=names(tuple(LAYERS)), default=list(LAYERS), help=f"of {', '.join(LAYERS)}")
    ap.add_argument("--routes", type=names(ROUTES), default=list(ROUTES), help=f"of {', '.join(ROUTES)}")
    ap.add_argument("--no-restart", dest="restart", action="store_false", help="skip the restart scenario")
    ap.add_argument(
        "--window",
        action="store_true",
        help="start nothing: print what a layer could add on this window of the trace (bench/serving/window.py)",
    )
    scale_options(ap)
    ap.add_argument("--json", type=Path, default=Path("bench/results/serve.json"), help="the rows (the PNG beside)")
    return ap


def main(argv: list[str] | None = None, pool: Any = None, prog: str | None = None) -> dict[str, Any]:
    """The matrix as ``argv`` asks; the kvpool layer on ``pool`` (a running pool's ``PoolConfig``, one node an
    engine) where given, else on a local pool of its own.  ``prog``: the command's name in its usage lines."""
    args = parser(prog).parse_args(argv)
    args.pool = pool
    if args.window:
        text = window.table(
            scaled_trace(args),
            args.engines,
            args.engine_blocks,
            args.hash_block,
            sorted({32, 64, 256, args.kvpool_chunk}),
        )
        print(text)
        return {"window": text}
    if args.model is None:
        from kvpool.prefill_decode.reference.model import converted_smollm2

        args.model = converted_smollm2()
    args.model_dir = args.model
    #: prefix-aware routing follows the engines' own KV events: every engine publishes them to the router's endpoint
    args.kv_events = f"tcp://127.0.0.1:{free_port('127.0.0.1')}" if "prefix-aware" in args.routes else ""
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-serve-") as tmp:
        work = Path(tmp)
        rows = scaled_trace(args)
        out: dict[str, Any] = {"scale": report.scale(args, rows), "rows": []}
        for name in args.layers:
            (work / name).mkdir()
            write_trace(rows, work / name / "trace.jsonl")
            out["rows"] += run_layer(name, args, rows, work / name)
            report.save(out, args.json)
    report.write(out, args.json)
    return out


if __name__ == "__main__":
    main()
