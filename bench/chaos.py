"""No wrong token under faults while serving: a Mooncake trace replayed at temperature 0 through real vLLM OpenAI
servers on a kvpool pool behind ``kvpool route`` (round-robin, so that a conversation's next turn lands on the other
engine and reads the pool), first with no fault (the reference), then once per fault kind with that fault injected
(``bench/serving/faults.py``: a PoolNode stopped past a READ's deadline, one stopped and continued in turn (a slow
peer), etcd killed and started again, bytes flipped in a node's DRAM, every node's DRAM held by rooms never filled (a
full pool), a PoolNode killed and started again, an engine killed).  Every answer is compared token by token with
the reference's, and its log-probabilities within ``--tolerance`` (absolute, 1e-3 by default); a token that differs
where the reference's top two were within that tolerance is a tie, not a wrong token (``bench/serving/client.py``).

The engines' own prefix caches are off unless ``--own-cache``: every prefix an engine reuses is then read from the
pool, its own node's or the other's, which is what the faults hit.  Each run starts cold: the pool emptied, the
engines' prefix caches reset, a fresh router; one unmeasured run warms the engines up first (``--warm-up``: its
first N requests only).  A fault is injected just
before the request a third of the way into the trace is sent, and ended ``--hold-s`` later (byte-flip and engine-kill
are instant; the killed engine stays down, so that kind runs last).  Per kind: requests, wrong tokens, logprobs off,
failed requests (by HTTP status), TTFT p50 / p99 against the reference's, the prompt tokens the engines took from the
pool (their ``/metrics``) against the reference's, and recovery: from the fault's end to the first token of the first
request sent after it whose TTFT is within 1.5x of the same request's in the reference ("n/a": none was).

Without a pool given, the bench runs its own: an etcd of its own (so that it may restart it) and one Ray node per
engine, each PoolNode with ``--pool-mib`` of DRAM and of NVMe (kept across restarts: a killed node takes back its
NVMe chunks).  The faults hit the PoolNode on engine 0's Ray node, and engine-kill the last engine.  The engines'
transfers speak TCP only (``UCX_TLS=tcp``): over shared memory a READ is the reader's own copy, which a stopped holder
cannot delay.  They compute in float32 (``--dtype``; in bfloat16, vLLM's CPU default, a log-probability moves by
2**-7 when the batch around a request changes).  The trace is scaled as ``bench/serve.py`` scales it; the harness's
settings this bench has no option for are ``bench/serve.py``'s defaults.

``--layer mooncake`` runs the same schedule on Mooncake Store below vLLM's own ``MooncakeStoreConnector`` instead
(``bench/serving/mooncake_faults.py``: its segment holder stalled, slowed, its bytes flipped, it or the master killed
and started again, an engine killed), in a network namespace of its own as ``bench/serve.py`` runs it, so that the
table says how the peer behaves under the faults kvpool is put through.

    python bench/chaos.py [--layer kvpool|mooncake] [--faults peer-stall,...] [--requests 30] [--hold-s 8] [--own-cache]
                          [--model DIR]
"""

import argparse
import dataclasses
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.exceptions import RayError
from rich.console import Console

from kvpool.bench import serve
from kvpool.bench.serve import quantiles
from kvpool.bench.serving import chaos_report, client, layers, mooncake_faults, report
from kvpool.bench.serving.faults import KINDS, Fault, Mixed, Victim, counted, fault
from kvpool.bench.serving.harness import (
    engine_process,
    fault_counts,
    health,
    reset,
    router,
    scaled_trace,
    tokens_by_source,
)
from kvpool.bench.serving.options import names, scale_options
from kvpool.errors import ConfigError, KvPoolError
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import MiB, PoolConfig
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.process import ServerProcess
from kvpool.stack import StackConfig, running_pool

console = Console(width=170)
T = TypeVar("T")


class Injection:
    """``fault`` injected on a thread of its own just before request ``at`` is sent (the replay waits until it is
    in), ended ``fault.hold_s`` later."""

    def __init__(self, fault: Fault, at: int) -> None:
        self.fault, self.at = fault, at
        self.injected_at = self.ended_at = 0.0
        self.error = ""
        self._in = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __call__(self, i: int) -> None:
        if i == self.at:
            self._thread.start()
            self._in.wait(120)

    def _run(self) -> None:
        try:
            self.fault.inject()
            self.injected_at = time.monotonic()
            self._in.set()
            time.sleep(self.fault.hold_s)
            self.fault.end()
        except (KvPoolError, OSError, RayError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.ended_at = time.monotonic()
            self._in.set()

    def join(self) -> None:
        if self._thread.ident is not None:  # started
            self._thread.join()


def cold_run(
    args: argparse.Namespace,
    layer: layers.Layer,
    urls: list[str],
    bodies: list[dict[str, Any]],
    at_s: list[float],
    log: Path,
    injection: Injection | None,
) -> tuple[list[client.Answer], float, dict[str, float]]:
    """One cold run over the engines of ``urls`` that answer: the answers, the prompt tokens they took from the pool
    (counted on the engines that answered before and after), and what the engines' kvpool fault counters grew by."""
    live = [u for u in urls if health(u) is None]
    reset(live)
    layer.empty()
    before = {u: tokens_by_source([u]) for u in live}
    counters = fault_counts(live)
    with router(live, "round-robin", log) as url:
        answers = client.replay(url, bodies, at_s, injection)
    if injection is not None:
        injection.join()
    answered = [u for u in live if health(u) is None]
    pooled = sum(tokens_by_source([u])["layer below"] - before[u]["layer below"] for u in answered)
    return answers, pooled, counted(counters, fault_counts(answered))


def row(
    kind: str,
    run: tuple[list[client.Answer], float, dict[str, float]],
    ref: list[client.Answer],
    injection: Injection | None,
    tol: float,
) -> dict[str, Any]:
    """The row of one run (``answers, pool tokens, counters``), with its TTFT quantiles and what its fault did."""
    answers, pooled, counters = run
    out = chaos_report.row(kind, answers, pooled, ref, tol)
    out["metrics"] = counters
    out.update(quantiles([a.ttft_s if a.ok else 0.0 for a in answers]))
    if injection is not None:
        start = min(a.sent_at for a in answers)
        out.update(injected_s=injection.injected_at - start, ended_s=injection.ended_at - start)
        out.update(recovery_s=chaos_report.recovery_s(answers, ref, injection.ended_at), error=injection.error)
        out["what"] = injection.fault.outcome()
        out["figures"] = {
            k: v for k, v in vars(injection.fault).items() if k[0] != "_" and isinstance(v, int | float | str)
        }
    return out


def started(stack: ExitStack, servers: list[AbstractContextManager[T]]) -> list[T]:
    """``servers`` entered at once (each engine's start-up waits on its own imports and model load), each left with
    ``stack``; the first error once all are in or failed."""
    with ThreadPoolExecutor(len(servers)) as threads:
        entered = [threads.submit(s.__enter__) for s in servers]
    for server, future in zip(servers, entered, strict=True):
        if future.exception() is None:
            stack.push(server.__exit__)
    return [future.result() for future in entered]


LAYER_KINDS = {"kvpool": KINDS, "mooncake": mooncake_faults.KINDS}  #: the fault kinds of each layer


def run_faults(args: argparse.Namespace, bodies: list[dict[str, Any]], at_s: list[float], work: Path) -> list[Any]:
    """The warm-up, the reference run, then a run per fault kind asked, on ``args.layer``: kvpool's ``args.pool``
    (its etcd ``args.etcd`` where this process runs it), or a Mooncake Store of the bench's own; their rows."""
    flags = [] if args.own_cache else ["--no-enable-prefix-caching"]
    with layers.factory(args.layer)(args, work) as layer, ExitStack() as stack:
        layer = dataclasses.replace(layer, env={**layer.env, "UCX_TLS": "tcp"})
        engines = started(
            stack, [engine_process(args, layer, i, work / f"engine{i}.log", flags) for i in range(args.engines)]
        )
        urls = [url for url, _ in engines]
        make = maker(args, layer, urls[0], engines[-1][1])
        warm = slice(0, args.warm_up)
        cold_run(args, layer, urls, bodies[warm], at_s[warm], work / "warm-up.route.log", None)
        ref = cold_run(args, layer, urls, bodies, at_s, work / "reference.route.log", None)
        rows = [row("none (reference)", ref, ref[0], None, args.tolerance)]
        console.print(f"  reference: {rows[0]['verdicts']}, {ref[1]:.0f} prompt tokens from the pool")
        if args.etcd is None and "etcd-restart" in args.faults:
            rows.append(
                {"fault": "etcd-restart", "skipped": "the pool was given: its etcd is not this bench's to restart"}
            )
        for kind, injection in injections(args, make, at_s):
            run = cold_run(args, layer, urls, bodies, at_s, work / f"{kind}.route.log", injection)
            rows.append(row(kind, run, ref[0], injection, args.tolerance))
            console.print(f"  {kind}: {rows[-1]['verdicts']}; {rows[-1]['what']}; {rows[-1]['error'] or 'no error'}")
    return rows


def maker(
    args: argparse.Namespace, layer: layers.Layer, url: str, engine: ServerProcess
) -> Callable[[str, float], Fault]:
    """What makes a fault of a kind, held so long, on ``args.layer``: a kvpool fault hits the PoolNode on the Ray node
    of the engine at ``url``, a Mooncake Store one the store's first holder or its master; engine-kill ``engine``."""
    if args.layer == "mooncake":
        store = mooncake_faults.StoreVictim(layer.servers, engine, args.pool_mib * MiB)
        return lambda kind, hold_s: mooncake_faults.fault(kind, store, hold_s)
    host = url.split("//")[1].split(":")[0]
    node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == host)
    victim = Victim(args.pool, node_id, args.etcd, engine)
    return lambda kind, hold_s: fault(kind, victim, hold_s)


def injections(
    args: argparse.Namespace, make: Callable[[str, float], Fault], at_s: list[float]
) -> Iterator[tuple[str, Injection]]:
    """The fault runs ``args`` asks for, after the reference: one per kind (each injected a third of the way into the
    trace), or with ``--mixed`` one whose faults follow each other from a tenth of the way to the last request."""
    kinds = sorted(args.faults, key=LAYER_KINDS[args.layer].index)  # engine-kill last: its engine stays down
    if args.etcd is None and "etcd-restart" in kinds:  # its row says why (run_faults)
        kinds.remove("etcd-restart")
    if args.mixed:
        at = len(at_s) // 10
        mixed = [k for k in kinds if k != "engine-kill"]  # a killed engine stays down: not one of a series
        series = Mixed(make, at_s[-1] - at_s[at], tuple(mixed), each_s=args.hold_s, gap_s=args.gap_s)
        yield "mixed", Injection(series, at=at)
        return
    for kind in kinds:
        yield kind, Injection(make(kind, args.hold_s), at=len(at_s) // 3)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--layer",
        choices=sorted(LAYER_KINDS),
        default="kvpool",
        help="the layer below the engines: kvpool, or Mooncake Store through vLLM's MooncakeStoreConnector (make "
        "bench-peer-mooncake; run it in a network namespace of its own, as bench/serve.py's docstring says)",
    )
    every = tuple(dict.fromkeys(k for kinds in LAYER_KINDS.values() for k in kinds))
    ap.add_argument(
        "--faults",
        type=names(every),
        help=f"kvpool's of {', '.join(KINDS)}; Mooncake Store's of {', '.join(mooncake_faults.KINDS)} (default: all "
        "of the layer's)",
    )
    ap.add_argument(
        "--hold-s",
        type=float,
        default=8.0,
        help="how long peer-stall, slow-peer, etcd-restart, full-pool, node-kill last",
    )
    ap.add_argument(
        "--mixed",
        action="store_true",
        help="one run whose faults (of --faults, engine-kill left out) follow each other, each held --hold-s with "
        "--gap-s between, from a tenth of the way into the trace to its last request (--requests / --speedup set how "
        "long), instead of a run per kind",
    )
    ap.add_argument("--gap-s", type=float, default=5.0, help="--mixed: seconds between one fault's end and the next")
    ap.add_argument(
        "--warm-up",
        type=int,
        help="requests of the trace's first that warm the engines up, unmeasured (default: all of them; a long --mixed "
        "run needs a few only)",
    )
    ap.add_argument("--tolerance", type=float, default=1e-3, help="log-probabilities equal within this (absolute)")
    ap.add_argument("--own-cache", action="store_true", help="keep the engines' own prefix caches on")
    scale_options(ap)
    ap.add_argument("--json", type=Path, default=Path("bench/results/chaos.json"), help="the rows")
    ap.add_argument("--logs", type=Path, help="keep the engines' and routers' logs there (default: removed)")
    return ap


def main(argv: list[str] | None = None, pool: PoolConfig | None = None, prog: str | None = None) -> dict[str, Any]:
    """The runs as ``argv`` asks, on ``pool`` (a running pool's config, one Ray node an engine) where given, else on
    a pool and an etcd of the bench's own.  ``prog``: the command's name in its usage lines."""
    args = parser(prog).parse_args(argv)
    kinds = LAYER_KINDS[args.layer]
    args.faults = args.faults or list(kinds)
    if set(args.faults) - set(kinds):
        raise ConfigError(f"--faults: {args.layer}'s are {', '.join(kinds)}, got {', '.join(args.faults)}")
    if args.mixed and not set(args.faults) - {"engine-kill", "etcd-restart" if pool is not None else ""}:
        raise ConfigError(f"--mixed needs a fault kind of --faults it can repeat on this pool, got {args.faults}")
    if args.warm_up is not None and args.warm_up < 1:
        raise ConfigError(f"--warm-up: a number of requests >= 1 (leave it out to warm up on all), got {args.warm_up}")
    for name, value in vars(serve.parser().parse_args([])).items():  # the harness's other settings: serve.py's
        args.__dict__.setdefault(name, value)
    if args.model is None:
        from kvpool.prefill_decode.reference.model import converted_smollm2

        args.model = converted_smollm2()
    args.model_dir, args.pool, args.etcd = args.model, pool, None
    rows = scaled_trace(args)
    vocab = int(json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])
    prompts = [client.prompt_tokens(r, args.hash_block, vocab) for r in rows]
    bodies = [client.body(str(args.model_dir), p, args.max_output) for p in prompts]
    at_s = [(r["timestamp"] - rows[0]["timestamp"]) / 1000 for r in rows]
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-chaos-") as tmp, ExitStack() as stack:
        work = args.logs or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.pool is None and args.layer == "kvpool":
            args.etcd = stack.enter_context(EmbeddedEtcd())
            (Path(tmp) / "nvme").mkdir()
            config = PoolConfig(
                metadata=MetadataConfig(endpoints=(args.etcd.endpoint,)),
                dram_bytes=args.pool_mib * MiB,
                nvme_bytes=args.pool_mib * MiB,
                nvme_dir=str(Path(tmp) / "nvme"),
            )
            args.pool = stack.enter_context(running_pool(StackConfig(nodes=args.engines, pool=config)))
        out: dict[str, Any] = {"scale": report.scale(args, rows), "tolerance": args.tolerance, "hold_s": args.hold_s}
        out.update(seconds=at_s[-1], own_cache="on" if args.own_cache else "off")
        out["layer"] = "kvpool" if args.layer == "kvpool" else "Mooncake Store"
        out["rows"] = run_faults(args, bodies, at_s, work)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    console.print(chaos_report.table(out))
    console.print(f"written {args.json}")
    return out


if __name__ == "__main__":
    main()
