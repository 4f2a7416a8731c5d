"""Time to first token on a real vLLM engine (CPU): cold, from kvpool, and from vLLM's own caches, in one run.

Starts its own pool (embedded etcd, a 2-node local Ray cluster on 127.0.0.2-3, a PoolNode on each) and vLLM engines
in processes of their own (``kvpool.prefill_decode.vllm.engine``), then for one long prompt per repeat measures the
wall time of a 1-token generation (= TTFT):

- cold: no connector, a prompt the engine has never seen;
- vLLM prefix-cache hit: the same prompt again in the same engine (the upper bound: nothing to move);
- kvpool, cold + save: engine A with the connector (kv_both) computing and saving the prompt;
- kvpool, restart: a fresh engine B on the same node answers the prompt from the pool (same-node DRAM);
- kvpool, NVMe-resident prefix: engine B's prompt moved to its node's NVMe, then asked again, as it is, after
  ``PoolClient.prefetch`` promoted it to DRAM (what the engine front does while a request waits for its engine), and
  with kvpool's prefetch hint in the request's ``kv_transfer_params`` (B's scheduler promotes it, the request waits);
- kvpool, P/D: a producer engine on the other node prefills, engine B answers from that node's DRAM (one-sided):
  its first such request, and the median of the later ones;
- model families beyond one full-attention group (tiny random-weight models, ``--families``): a sliding-window hybrid
  (Gemma3) and MLA (DeepSeek-V2 on each CPU MLA backend: CPU_MLA, float32; AMX_MLA, bf16, where the CPU has AMX,
  else a row says why not), each cold + save in one engine and from the pool in a fresh one, beside the first
  engine's own prefix hit where vLLM keeps its prefix cache on (not under CPU_MLA);
- vLLM OffloadingConnector (CPU) and SimpleCPUOffloadConnector: the prompt again after ``reset_prefix_cache``,
  served from their CPU store; ExampleConnector: the same from its disk files — each where it runs on this
  platform, else the reason it does not.

Beside them: the prompt's KV bytes, the memcpy limit in the same run and the floor it sets for moving that KV.

    python bench/vllm.py [--model smollm2|tiny] [--tokens 4096] [--chunk-size 256] [--repeat 3] [--families ...]
                         [--json ...]
"""

import argparse
import json
import re
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool.bench.limits import memcpy_gbps
from kvpool.core.keys import CacheIdentity
from kvpool.core.types import Tier
from kvpool.errors import WorkerUnavailable
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.prefill_decode.vllm.cpu_backends import MLA_BACKENDS, unavailable
from kvpool.prefill_decode.vllm.engine import EngineProcess
from kvpool.prefill_decode.vllm.front import engine_keys, wait_saved
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.ray_cluster import LocalRayCluster

console = Console(width=150)
FAMILY_NAMES = ("gemma3-sliding", "deepseek-v2-mla")  #: the families bench/vllm.py can run (tiny_models.FAMILIES)


def model_dir(name: str, work: Path) -> tuple[Path, int, dict[str, int]]:
    """The model's directory, its longest context, and what sizes its KV (layers, kv heads, head size)."""
    if name == "smollm2":
        from kvpool.prefill_decode.reference.model import converted_smollm2

        path = converted_smollm2()
    else:
        from kvpool.prefill_decode.reference.model import tiny_llama

        path = work / "tiny-llama"
        tiny_llama(layers=8, hidden=512, heads=8, kv_heads=2, vocab=4096, max_positions=8192).model.save_pretrained(
            path
        )
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    shape = {
        "layers": cfg["num_hidden_layers"],
        "kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_size": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }
    return path, int(cfg["max_position_embeddings"]), shape


def prompt(seed: int, n: int, vocab: int = 4000) -> list[int]:
    return [(seed * 7919 + i * 104729) % vocab + 1 for i in range(n)]


def ttft(
    engine: EngineProcess, prompts: list[list[int]], reset: bool = False, params: dict[str, Any] | None = None
) -> tuple[float, int]:
    """Median seconds to the first token over ``prompts`` (one generate each, with ``kv_transfer_params``
    ``params``), and the tokens the last had cached."""
    seconds, cached = [], 0
    for p in prompts:
        [out] = engine.generate([p], reset=reset, max_tokens=1, kv_transfer_params=params)
        seconds.append(out["seconds"])
        cached = out["cached"]
    return statistics.median(seconds), cached


def from_pool(engine: EngineProcess, prompts: list[list[int]]) -> tuple[float, int, str]:
    """:func:`ttft` of ``prompts`` after ``reset_prefix_cache`` (so the connector loads them), and a note of the
    connector's own load time per prompt (its I/O thread's, from its counts): the rest of a TTFT is the engine's."""
    before = engine.ask(connector=True)["totals"].get("load_seconds", 0.0)
    seconds, cached = ttft(engine, prompts, reset=True)
    spent = (engine.ask(connector=True)["totals"].get("load_seconds", 0.0) - before) / len(prompts)
    return seconds, cached, f"the connector's load: {spent * 1e3:.0f} ms"


@dataclass
class Cases:
    """The rows of one run, and fresh prompts (never seen by any engine) for each case."""

    tokens: int  #: prompt length
    repeat: int  #: prompts per case
    rows: list[dict[str, Any]] = field(default_factory=list)
    seeds: Iterator[int] = field(default_factory=lambda: iter(range(1, 1000)))

    def fresh(self, tokens: int | None = None) -> list[list[int]]:
        return [prompt(next(self.seeds), tokens or self.tokens) for _ in range(self.repeat)]

    def add(self, name: str, seconds: float | None, cached: int = 0, note: str = "") -> None:
        self.rows.append({"case": name, "ttft_s": seconds, "cached_tokens": cached, "note": note})
        done = (
            f"{seconds:.3f} s, {cached} tokens cached" + (f" ({note})" if note else "") if seconds is not None else note
        )
        console.print(f"  {name}: {done}")


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    path, longest, shape = model_dir(args.model, work)
    tokens = min(args.tokens, longest - 8)
    kv_bytes = tokens * shape["layers"] * 2 * shape["kv_heads"] * shape["head_size"] * 4  # float32
    settings = {"model": str(path), "max_model_len": tokens + 8}
    cases = Cases(tokens, args.repeat)
    limits = {"memcpy_gbps": memcpy_gbps()}
    console.print(
        f"[bold]{args.model}[/]: {tokens} tokens, KV {kv_bytes / MiB:.0f} MiB; memcpy {limits['memcpy_gbps']:.1f} GB/s"
    )

    # every case runs while the pool is up, so all of them share the same machine (its processes use some CPU)
    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2) as cluster:
        metadata = MetadataConfig(endpoints=(etcd.endpoint,), cluster=f"bench-{uuid.uuid4().hex[:8]}")
        pool = PoolConfig(metadata=metadata, dram_bytes=args.dram_mib * MiB, nvme_bytes=args.dram_mib * MiB)
        start_pool(pool)
        extra = {
            "etcd": [etcd.endpoint],
            "cluster": metadata.cluster,
            "namespace": pool.namespace,
            "ray_address": cluster.address,
            "model_id": f"bench-{args.model}",
            "chunk_size": args.chunk_size,
        }
        try:
            plain_cases(settings, work, cases)
            kvpool_cases(settings, extra, cluster.node_ids(), work, cases, pool)
            family_cases(args.families, extra, work, cases)
            vllm_cases(settings, vllm_connectors(work, kv_bytes, args.repeat), work, cases)
        finally:
            stop_pool(pool)

    run = {"model": args.model, "tokens": tokens, "chunk_size": args.chunk_size, "kv_bytes": kv_bytes}
    return {**run, "repeat": args.repeat, "limits": limits, "rows": cases.rows}


def plain_cases(settings: dict[str, Any], work: Path, cases: Cases) -> None:
    """No connector: a cold prompt, then the same prompt again (vLLM's own prefix cache)."""
    with EngineProcess(settings, work / "plain.log") as plain:
        ttft(plain, [prompt(999, 64)])  # warm-up: the first forward of an engine is slow
        cold = cases.fresh()
        cases.add("cold (no connector)", *ttft(plain, cold))
        cases.add("vLLM prefix-cache hit", *ttft(plain, cold))


def kvpool_cases(
    settings: dict[str, Any], extra: dict[str, Any], ids: list[str], work: Path, cases: Cases, pool: PoolConfig
) -> None:
    """With kvpool's connector: engine A saves, a producer on the other node prefills, then a fresh engine B on A's
    node reloads A's prompts, answers a prefix left on its node's NVMe with and without a prefetch, and answers what
    the producer prefilled (P/D).  A and the producer each run alone on the machine, as the cold row's engine does: a
    second vLLM engine alive, even idle and without a connector, made another's cold requests up to 1.5x slower here
    for a while (2 cores)."""
    warm, pd = cases.fresh(), cases.fresh()
    with EngineProcess({**settings, "connector": {**extra, "node_ip": "127.0.0.2"}}, work / "a.log") as a:
        ttft(a, [prompt(998, 64)])
        cases.add("kvpool: cold + save (kv_both)", *ttft(a, warm))
        wait_saved(a, len(warm) * (cases.tokens // extra["chunk_size"]) * extra["chunk_size"])  # then B is fresh
    producer = {**settings, "role": "kv_producer", "connector": {**extra, "node_ip": "127.0.0.3"}}
    with EngineProcess(producer, work / "producer.log") as p:
        ttft(p, [prompt(996, 64)])
        cases.add("kvpool: P/D producer, cold + save (kv_producer)", *ttft(p, pd))
    with EngineProcess({**settings, "connector": {**extra, "node_ip": "127.0.0.2"}}, work / "b.log") as b:
        ttft(b, [prompt(997, 64)])
        cases.add("kvpool: restart, same node", *from_pool(b, warm))
        nvme_cases(b, pool, ids[0], cases)
        # B's first read from the producer's node, then the steady state
        where = f"prefill {ids[1][:8]}, decode {ids[0][:8]}"
        cases.add(f"kvpool: P/D first request ({where})", *from_pool(b, pd[:1]))
        if pd[1:]:
            cases.add("kvpool: P/D, later requests", *from_pool(b, pd[1:]))
        totals = b.ask(connector=True)["totals"]
        if totals.get("load_errors"):
            console.print(f"[yellow]  {int(totals['load_errors'])} blocks failed to load and were recomputed[/]")


def nvme_cases(engine: EngineProcess, pool: PoolConfig, node: str, cases: Cases) -> None:
    """A prefix the pool holds on the NVMe of the engine's node: loaded as it is (the engine's read promotes it),
    promoted to DRAM by ``PoolClient.prefetch`` before the request (what a router does while the request waits), or
    asked for with kvpool's prefetch hint (the engine's scheduler promotes it while the request waits)."""
    from kvpool.pool.client import PoolClient

    state = engine.ask(connector=True)
    identity, layers = CacheIdentity(**state["identity"]), state["layers"]
    hint = {"kvpool": {"prefetch": True}}
    with PoolClient(pool) as client:
        for how in ("", "client", "hint"):
            prompts = cases.fresh()
            saved = engine.ask(connector=True)["totals"].get("saved_tokens", 0)
            ttft(engine, prompts)  # computed and saved
            per_prompt = [[k for chunk in engine_keys(identity, layers, p, None) for k in chunk] for p in prompts]
            keys = [k for ks in per_prompt for k in ks]
            wait_saved(engine, saved + len(keys) // layers * identity.chunk_size)
            client.cache.sync()
            if how == "hint":  # its first hint makes the scheduler's prefetch client: on a prompt held in DRAM
                ttft(engine, prompts[:1], reset=True, params=hint)
            client.move(keys, Tier.NVME)
            note, name = "the engine's load promotes it", "kvpool: NVMe-resident prefix"
            if how == "client":
                started = time.perf_counter()
                promoted = sum(client.prefetch(ks, node).promoted for ks in per_prompt)  # each prompt's own chain
                note = f"prefetch promoted {promoted} objects in {time.perf_counter() - started:.2f} s before"
                name += ", prefetched to DRAM"
            if how != "hint":
                cases.add(name, *ttft(engine, prompts, reset=True), note=note)
                continue
            before = engine.ask(connector=True)["totals"].get("prefetch_promoted", 0)
            seconds, cached = ttft(engine, prompts, reset=True, params=hint)
            promoted = engine.ask(connector=True)["totals"].get("prefetch_promoted", 0) - before
            note = f"its scheduler promoted {promoted:.0f} objects first, the request waiting"
            cases.add(name + ", request's prefetch hint", seconds, cached, note=note)


def family_variants(name: str) -> list[tuple[str, dict[str, Any], bool, str]]:
    """How family ``name`` runs: per variant its rows' label, its engine settings, whether vLLM keeps its own prefix
    cache on, and why this host cannot run it ("": it can).  MLA runs once per CPU MLA backend (CPU_MLA, and AMX_MLA
    where the CPU has AMX: :mod:`~kvpool.prefill_decode.vllm.cpu_backends`)."""
    if not name.endswith("-mla"):
        return [(name, {}, True, "")]
    return [(f"{name} ({b.name}, {b.dtype})", b.settings(), b.prefix_caching, unavailable(b)) for b in MLA_BACKENDS]


def family_cases(families: list[str], extra: dict[str, Any], work: Path, cases: Cases) -> None:
    """Each family's tiny model (each MLA backend this host runs): engine A computes and saves (then answers again
    from its own prefix cache), a fresh engine B answers from the pool.  Their prompts are as long as the run's,
    within the tiny models' context."""
    from kvpool.prefill_decode.reference.tiny_models import COMMON, save_tiny

    tokens = min(cases.tokens, COMMON["max_position_embeddings"] - 8)
    for name in families:
        model = str(save_tiny(name, work))
        for label, backend, own_cache, why_not in family_variants(name):
            if why_not:
                cases.add(f"{label}: not run", None, note=why_not)
                continue
            settings = {"model": model, "max_model_len": tokens + 8, **backend}
            connector = {**extra, "node_ip": "127.0.0.2", "model_id": f"bench-{label}"}
            prompts = cases.fresh(tokens)
            log = work / f"{name}-{backend.get('attention_backend', 'auto')}"
            with EngineProcess({**settings, "connector": connector}, log.with_suffix(".a.log")) as a:
                ttft(a, [prompt(995, 64)])
                cases.add(f"{label}: cold + save (kv_both)", *ttft(a, prompts))
                hit = ttft(a, prompts) if own_cache else (None, 0, "vLLM turns its prefix cache off here")
                cases.add(f"{label}: vLLM prefix-cache hit", *hit)
                wait_saved(a, len(prompts) * (tokens // extra["chunk_size"]) * extra["chunk_size"])
            with EngineProcess({**settings, "connector": connector}, log.with_suffix(".b.log")) as b:
                ttft(b, [prompt(994, 64)])
                cases.add(f"{label}: restart, same node", *from_pool(b, prompts))


def vllm_cases(settings: dict[str, Any], connectors: dict[str, dict[str, Any]], work: Path, cases: Cases) -> None:
    """vLLM's own connectors: the prompt again after ``reset_prefix_cache``, or why one does not run here."""
    for name, transfer in connectors.items():
        try:
            with EngineProcess({**settings, "kv_transfer": transfer}, work / f"{name}.log") as e:
                ttft(e, [prompt(996, 64)])
                prompts = cases.fresh()
                ttft(e, prompts)  # computes and stores
                cases.add(f"vLLM {name}", *ttft(e, prompts, reset=True))
        except (RuntimeError, WorkerUnavailable) as exc:  # it does not start here, or stops on the first prompt
            lines = str(exc).splitlines()
            reason = next((ln for ln in reversed(lines) if re.search(r"(Error|Exception)\b", ln)), lines[0])
            cases.add(f"vLLM {name}", None, note=f"does not run here: {reason.split(']: ')[-1].strip()[:120]}")


def vllm_connectors(work: Path, kv_bytes: int, repeat: int) -> dict[str, dict[str, Any]]:
    store = (repeat + 2) * kv_bytes  # room for every prompt a case stores
    return {
        "OffloadingConnector (CPU)": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": store},
        },
        "SimpleCPUOffloadConnector": {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": store},
        },
        "ExampleConnector (disk)": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "example-connector")},
        },
    }


def show(result: dict[str, Any]) -> None:
    """The table: each row's ratios against its own model's cold and prefix-hit rows (a family's rows are named
    ``<family>: ...``)."""
    rows = result["rows"]

    def first(model: str, start: str) -> float | None:
        return next((r["ttft_s"] for r in rows if r["case"].startswith(start) and _model(r) == model), None)

    floor = result["kv_bytes"] / (result["limits"]["memcpy_gbps"] * 1e9)
    table = Table(
        title=f"TTFT, {result['model']} (and other families' tiny models), {result['tokens']}-token prompt, kvpool "
        f"chunks of {result['chunk_size']} tokens, median of {result['repeat']} (CPU)"
    )
    for col in ("case", "TTFT", "cold / TTFT", "TTFT / prefix hit", "cached tokens", "note"):
        table.add_column(col, justify="left" if col in ("case", "note") else "right")
    for r in rows:
        s = r["ttft_s"]
        if s is None:
            table.add_row(r["case"], "-", "-", "-", "-", r["note"])
            continue
        prefix = f"{_model(r)}: " if _model(r) else ""
        cold, hit = first(_model(r), prefix + "cold"), first(_model(r), prefix + "vLLM prefix-cache hit")
        table.add_row(
            r["case"],
            f"{s * 1e3:.0f} ms",
            f"{cold / s:.1f}x" if cold else "-",
            f"{s / hit:.2f}" if hit else "-",
            str(r["cached_tokens"]),
            r["note"],
        )
    note = (
        f"{result['kv_bytes'] / MiB:.0f} MiB at {result['limits']['memcpy_gbps']:.1f} GB/s (+ one step: the prefix hit)"
    )
    table.add_row("limit: move the KV at memcpy speed", f"{floor * 1e3:.0f} ms", "", "", "", note)
    console.print(table)


def _model(row: dict[str, Any]) -> str:
    """The family (and backend) a row belongs to ('' for the run's main model)."""
    head = row["case"].split(":", 1)[0]
    return head if head.split(" (", 1)[0] in FAMILY_NAMES else ""


def families(text: str) -> list[str]:
    """``--families``: names of :data:`FAMILY_NAMES`, comma-separated, or ``none``."""
    names = [f for f in text.split(",") if f and f != "none"]
    if unknown := set(names) - set(FAMILY_NAMES):
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(sorted(unknown))}: name some of {', '.join(FAMILY_NAMES)}"
        )
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        choices=("smollm2", "tiny"),
        default="smollm2",
        help="SmolLM2-135M (real weights) or a random 8-layer Llama",
    )
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (capped by the model's context)")
    ap.add_argument("--chunk-size", type=int, default=256, help="kvpool's tokens per chunk (a multiple of 32)")
    ap.add_argument("--repeat", type=int, default=3, help="prompts per case (median)")
    ap.add_argument("--dram-mib", type=int, default=2048, help="DRAM (and NVMe) of each pool node")
    ap.add_argument(
        "--families",
        type=families,
        default=",".join(FAMILY_NAMES),
        help=f"tiny models of other families to run too, comma-separated ({', '.join(FAMILY_NAMES)}), or none",
    )
    ap.add_argument("--json", default="bench/results/vllm.json", help="where to write the figures")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-") as work:
        result = run(args, Path(work))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    show(result)
    console.print(f"written {out}")


if __name__ == "__main__":
    main()
