"""The serving harness: a scaled trace, the engines of one layer, ``kvpool route`` in front, ``vllm bench serve``
replaying the trace, and the engines' own counts of where their prompt tokens came from."""

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvpool.bench.serving.layers import Layer
from kvpool.bench.workloads.mooncake import BLOCK_TOKENS, trace_path
from kvpool.core.net import free_port
from kvpool.errors import KvPoolError, WorkerUnavailable
from kvpool.prefill_decode.front.engine_prefixes import events_config
from kvpool.servers.process import ServerProcess

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # its POST /reset_prefix_cache: each run starts cold
}
#: prompt tokens by where they came from, in vLLM's own counters (summed over the engines)
SOURCES = {"computed": "local_compute", "own cache": "local_cache_hit", "layer below": "external_kv_transfer"}
#: ``vllm bench serve`` as its module runs (vllm-cpu's console script fails on its missing distribution metadata)
LOAD = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)


def scaled_trace(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The trace's rows as this machine replays them (``bench/serve.py``'s docstring)."""
    rows: list[dict[str, Any]] = []
    with open(trace_path(args.trace)) as f:
        for line in f:
            if len(rows) == args.requests:
                break
            row = json.loads(line)
            if len(row["hash_ids"]) < 2 or row["hash_ids"][1] % args.sample:  # every request starts with block 0
                continue
            ids = row["hash_ids"][: max(1, args.max_input // args.hash_block)]
            tokens = min(row["input_length"] * args.hash_block // BLOCK_TOKENS, len(ids) * args.hash_block)
            rows.append({**row, "hash_ids": ids, "input_length": max(1, tokens), "output_length": args.max_output})
    return [{**r, "timestamp": r["timestamp"] / args.speedup} for r in rows]


def write_trace(rows: list[dict[str, Any]], out: Path) -> Path:
    """``rows`` as JSONL for ``vllm bench serve``, timestamps from 0."""
    start = rows[0]["timestamp"] if rows else 0
    out.write_text("".join(json.dumps({**r, "timestamp": r["timestamp"] - start}) + "\n" for r in rows))
    return out


def _get(url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def health(url: str) -> str | None:
    """None once ``url`` answers ``/health``; else why not."""
    try:
        _get(f"{url}/health", 5)
        return None
    except OSError as exc:
        return str(exc)


@contextmanager
def engine(args: argparse.Namespace, layer: Layer, i: int, log: Path) -> Iterator[str]:
    """vLLM OpenAI server ``i`` on 127.0.0.{2 + i mod engines}, with a small KV cache of its own (``--engine-blocks``),
    in ``--dtype``, on core ``i`` alone with ``--bind-cores``, and the layer's config; its URL once it answers
    ``/health``."""
    with engine_process(args, layer, i, log) as (url, _):
        yield url


@contextmanager
def engine_process(
    args: argparse.Namespace,
    layer: Layer,
    i: int,
    log: Path,
    flags: Sequence[str] = (),
    env: Mapping[str, str] = MappingProxyType({}),
) -> Iterator[tuple[str, ServerProcess]]:
    """:func:`engine`'s URL and its process (to kill it: ``bench/chaos.py``), with vLLM's ``flags`` and ``env``
    besides."""
    host = f"127.0.0.{2 + i % args.engines}"
    port = free_port(host)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir)]
    cmd += ["--host", host, "--port", str(port), "--enforce-eager", "--seed", "0", "--block-size", "32"]
    cmd += ["--max-model-len", str(args.max_input + args.max_output + 64)]
    cmd += ["--num-gpu-blocks-override", str(args.engine_blocks), "--disable-uvicorn-access-log"]
    cmd += ["--dtype", args.dtype, *flags]
    if args.bind_cores:  # engine i computes on core i alone
        env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % args.engines % (os.cpu_count() or 1))}
    kv_transfer = layer.kv_transfer(i, host)
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
    if getattr(args, "kv_events", ""):  # what its prefix cache stores and evicts, to the prefix-aware router
        cmd += ["--kv-events-config", json.dumps(events_config(args.kv_events, i))]
    server = ServerProcess(f"engine {i}", cmd, log, env={**os.environ, **ENGINE_ENV, **layer.env, **env}, grace_s=30)
    url = f"http://{host}:{port}"
    server.start(functools.partial(health, url), 900, WorkerUnavailable, poll_s=1.0)
    try:
        yield url, server
    finally:
        server.stop()


def reset(urls: list[str], deadline_s: float = 120.0) -> None:
    """Empty every engine's own prefix cache (vLLM refuses while blocks are held: asked again until it takes)."""
    for url in urls:
        for _ in range(int(deadline_s / 0.5)):
            ask = urllib.request.Request(f"{url}/reset_prefix_cache", b"", method="POST")
            with urllib.request.urlopen(ask, timeout=30) as r:
                if json.loads(r.read() or b"{}").get("success", True):
                    break
        else:
            raise WorkerUnavailable(f"{url} kept its prefix cache for {deadline_s:.0f} s")


def tokens_by_source(urls: list[str]) -> dict[str, float]:
    """Prompt tokens by where they came from, summed over the engines (their ``/metrics``)."""
    return _counted(urls, {k: _sample("vllm:prompt_tokens_by_source_total", "source", v) for k, v in SOURCES.items()})


def connector_counts(urls: list[str]) -> dict[str, float]:
    """What kvpool's connector did, summed over the engines: seconds its I/O thread spent loading and saving, chunks it
    could not load (recomputed) and save batches it dropped; all 0 where an engine runs another layer."""
    samples = {f"{d}_s": _sample("vllm:kvpool_seconds_total", "direction", d) for d in ("load", "save")}
    samples |= {f"{d}_errors": _sample("vllm:kvpool_errors_total", "direction", d) for d in ("load", "save")}
    return _counted(urls, samples)


#: what the router counted (its ``/metrics``): prompt blocks, those the upstream it picked held (prefix-aware), and
#: the engines' KV events it followed
ROUTER_COUNTS = {
    "prompt_blocks": r"^kvpool_route_prompt_blocks_total{[^}]*} (\S+)$",
    "matched_blocks": r"^kvpool_route_matched_blocks_total{[^}]*} (\S+)$",
    "kv_events": r"^kvpool_route_kv_events_total{[^}]*} (\S+)$",
}
#: kvpool's fault counters in an engine's ``/metrics`` (``prefill_decode/vllm/stats.py``), by the label that says which
FAULT_METRICS = {
    "vllm:kvpool_transfer_faults_total": "kind",
    "vllm:kvpool_misses_total": "cause",
    "vllm:kvpool_errors_total": "direction",
    "vllm:mooncake_store_operation_failed_keys_total": "operation",  # vLLM's MooncakeStoreConnector's
}


def fault_counts(urls: list[str]) -> dict[str, dict[str, float]]:
    """Per engine, its connector's :data:`FAULT_METRICS` from its ``/metrics`` (:func:`faults_in`)."""
    return {url: faults_in(_get(f"{url}/metrics")) for url in urls}


def faults_in(text: str) -> dict[str, float]:
    """An engine's :data:`FAULT_METRICS` in its metrics ``text`` as ``name{value}``, summed over its other labels:
    its transfers with other nodes that went wrong, its lookups and loads that fell short by cause, its chunks not
    loaded and batches not saved (Mooncake Store's connector: its keys that failed, by operation).  Counted in the
    engine, so a pool node killed meanwhile takes none of them with it; none where an engine runs no such layer."""
    out: dict[str, float] = {}
    for metric, label in FAULT_METRICS.items():
        for value, n in re.findall(rf'^{metric}{{[^}}]*\b{label}="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
            out[f"{metric}{{{value}}}"] = out.get(f"{metric}{{{value}}}", 0.0) + float(n)
    return out


def engine_seconds(urls: list[str]) -> dict[str, float]:
    """Seconds the engines' requests spent waiting to be scheduled, in prefill and in decode (vLLM's histograms'
    sums), summed over the engines and requests: where a layer's TTFT goes."""
    phases = {"queued": "queue", "prefill": "prefill", "decode": "decode"}
    return _counted(urls, {k: _sample(f"vllm:request_{v}_time_seconds_sum") for k, v in phases.items()})


def _sample(metric: str, label: str = "", value: str = "") -> str:
    """A pattern of ``metric``'s sample lines (with ``label="value"``, if given), its value the group."""
    labels = rf'[^}}]*{label}="{value}"[^}}]*' if label else "[^}]*"
    return rf"^{metric}{{{labels}}} (\S+)$"


def _counted(urls: list[str], samples: Mapping[str, str]) -> dict[str, float]:
    """Per name, the values of the sample lines its pattern (:func:`_sample`) finds, summed over the engines."""
    out = dict.fromkeys(samples, 0.0)
    for url in urls:
        text = _get(f"{url}/metrics")
        for name, pattern in samples.items():
            out[name] += sum(float(found) for found in re.findall(pattern, text, re.M))
    return out


@contextmanager
def router(urls: list[str], policy: str, log: Path, kv_events: str = "", tokenizer: str = "") -> Iterator[str]:
    """``kvpool route`` over ``urls``, as a user starts it (with ``kv_events``: following the engines' KV events
    there, prompts read with ``tokenizer``); its URL."""
    port = free_port("127.0.0.1")
    cmd = [str(Path(sys.executable).with_name("kvpool")), "route", "--policy", policy, "--port", str(port)]
    cmd += [arg for url in urls for arg in ("--upstream", url)]
    if kv_events:
        cmd += ["--kv-events", kv_events, "--tokenizer", tokenizer]
    server = ServerProcess("kvpool route", cmd, log)
    url = f"http://127.0.0.1:{port}"
    # with --tokenizer it imports transformers first: over a minute on a loaded 2-core machine
    server.start(lambda: health(url), 300, KvPoolError, poll_s=0.3)
    try:
        yield url
    finally:
        server.stop()


def replay(args: argparse.Namespace, url: str, trace: Path, out: Path) -> dict[str, Any]:
    """``vllm bench serve`` replaying ``trace`` against ``url``; its result JSON (per-request TTFTs in the trace's
    order too)."""
    requests = sum(1 for _ in trace.open())
    load = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    load += ["--model", str(args.model_dir), "--dataset-name", "timed_trace", "--dataset-path", str(trace)]
    load += ["--timed-trace-chunk-hash-size", str(args.hash_block), "--num-prompts", str(requests)]
    load += ["--timed-trace-sec-multiplier", "0.001"]  # the trace's timestamps are milliseconds
    load += ["--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm"]
    load += ["--temperature", "0", "--ignore-eos"]
    load += ["--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", LOAD, *load], capture_output=True, text=True, env=env, timeout=7200)
    if done.returncode != 0 or not out.exists():
        raise WorkerUnavailable(f"vllm bench serve failed ({done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def served(args: argparse.Namespace, urls: list[str], policy: str, trace: Path, out: Path) -> dict[str, Any]:
    """``trace`` replayed through ``kvpool route --policy policy`` over ``urls``: the replay's result with the prompt
    tokens by source the engines counted meanwhile (``tokens``), what kvpool's connector did (``connector``: load /
    save seconds and errors) and the requests' seconds queued / in prefill / in decode (``phases_s``)."""
    counters = (tokens_by_source, connector_counts, engine_seconds)
    before = [count(urls) for count in counters]
    events = getattr(args, "kv_events", "") if policy == "prefix-aware" else ""
    with router(urls, policy, out.with_suffix(".route.log"), events, str(args.model_dir)) as url:
        result = replay(args, url, trace, out)
        routed = _counted([url], ROUTER_COUNTS)
    after = [count(urls) for count in counters]
    tokens, connector, phases = ({k: a[k] - b[k] for k in b} for a, b in zip(after, before, strict=True))
    return {**result, "tokens": tokens, "connector": connector, "phases_s": phases, "router": routed}
