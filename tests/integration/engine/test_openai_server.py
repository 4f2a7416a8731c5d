"""vLLM's OpenAI server with the connector, started exactly as ``kvpool up --hold`` prints it: a user's path end to
end.  ``kvpool up --hold`` brings a pool up (its own etcd and Ray cluster) and prints the server line; the line runs
in a shell with the model put in for ``MODEL`` (and a port).  The server runs vLLM's engine core in a process of its
own (not the in-process engine the other engine tests use).  Asked the demo's question about SmolLM2's document
again, it answers from the chunks it saved the first time (``cached_tokens``, its own prefix cache off), with the
same text.  The SGLang server line printed beside it carries the flags ``kvpool sglang-config`` prints for that
pool."""

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_asks import health

from kvpool.core.net import free_port
from kvpool.errors import KvPoolError, WorkerUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.prefill_decode.reference.demo import demo_prompt
from kvpool.prefill_decode.reference.model import converted_smollm2
from kvpool.prefill_decode.sglang.config import StorageConfig
from kvpool.servers.process import ServerProcess

HOST = "127.0.0.2"  #: the first node of ``kvpool up``'s local cluster, where the servers run
CHUNK = 256  #: the connector's default chunk size
#: kvpool's hint in a request body, as a user or a router writes it (docs/vllm.md)
PREFETCH_HINT = {"kvpool": {"prefetch": True}}
#: what a CPU machine's user sets for vLLM (not the connector's business): a small KV space, no core binding, offline
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}


class Held:
    """What ``kvpool up --hold`` printed: the export line for another shell, the vLLM and SGLang server lines, the
    pool's etcd and cluster."""

    def __init__(self, log: str) -> None:
        self.exports = _line(log, "In another shell, first: ")
        self.server_line = _line(log, "vLLM on it: ")
        self.sglang_line = _line(log, "SGLang on it: ")
        where = _line(log, "In another shell: kvpool status ")
        found = re.fullmatch(r"--etcd (\S+) --cluster (\S+)", where)
        assert found is not None, where
        self.etcd, self.cluster = found[1], found[2]


def _line(log: str, marker: str) -> str:
    (found,) = [line.split(marker, 1)[1].strip() for line in log.splitlines() if marker in line]
    return found


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    """``kvpool up --hold`` on one node with no demo, until the module's tests are done."""
    log = tmp_path_factory.mktemp("up") / "up.log"
    kvpool = str(Path(sys.executable).with_name("kvpool"))
    args = [kvpool, "up", "--hold", "--nodes", "1", "--dram-mib", "256", "--nvme-mib", "256", "--demo", "none"]
    env = {k: v for k, v in os.environ.items() if k not in (ENDPOINTS_ENV, "RAY_ADDRESS")} | {"COLUMNS": "400"}
    up = ServerProcess("kvpool up --hold", args, log, env=env, grace_s=30)
    up.start(lambda: None if "Ctrl-C" in log.read_text() else "not held yet", 300, KvPoolError, poll_s=0.5)
    try:
        yield Held(log.read_text())
    finally:
        up.stop()


def serve(held: Held, model: Path, log: Path) -> tuple[ServerProcess, str]:
    """The printed line run in a shell after the printed export, ``MODEL`` replaced and a port added; its URL."""
    port = free_port(HOST)
    line = held.server_line.replace(" --model MODEL ", f" --model {shlex.quote(str(model))} ", 1)
    #: the user's own flags: where to listen, the usage details the test reads, no torch.compile (minutes on 2 cores),
    #: no prefix cache of vLLM's own (what a repeated prompt finds cached then comes from the pool)
    extra = (
        f"--host {HOST} --port {port} --enable-prompt-tokens-details --max-model-len 2048 --seed 0 --enforce-eager"
        " --no-enable-prefix-caching"
    )
    env = {k: v for k, v in os.environ.items() if k not in (ENDPOINTS_ENV, "RAY_ADDRESS")} | VLLM_CPU_ENV
    server = ServerProcess("vLLM's OpenAI server", ["bash", "-c", f"{held.exports}; {line} {extra}"], log, env=env)
    url = f"http://{HOST}:{port}"
    server.start(lambda: health(url), 600, WorkerUnavailable, poll_s=1.0)
    return server, url


def complete(url: str, model: Path, prompt: str, kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0}
    if kv_transfer_params is not None:  # a request body's field vLLM's server hands to the connector as it is
        body["kv_transfer_params"] = kv_transfer_params
    ask = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(ask, timeout=300) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def saved_chunks(held: Held) -> int:
    """The chunk objects the pool holds now (each layer of each chunk is one)."""
    etcd = EtcdClient(MetadataConfig(endpoints=(held.etcd,), cluster=held.cluster))
    try:
        with MetadataCache(etcd, Namespace(held.cluster)) as cache:
            cache.sync()
            return cache.chunk_count()
    finally:
        etcd.close()


@pytest.fixture(scope="module")
def server(held: Held, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server started as the printed line says, for the module's tests; its URL."""
    proc, url = serve(held, converted_smollm2(), tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield url
    finally:
        proc.stop()


@pytest.mark.timeout(1200)
def test_an_openai_server_answers_a_prompt_again_from_the_chunks_it_saved(held: Held, server: str) -> None:
    """vLLM's own prefix cache off (the user's ``--no-enable-prefix-caching``): the repeated prompt's cached tokens
    can only come from the pool.  (A fresh engine in another process loading what another saved:
    test_vllm_connector.py's fresh-engine test.)"""
    model = converted_smollm2()
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    prompt, url = demo_prompt(), server
    before = saved_chunks(held)  # kvpool up's own check
    cold = complete(url, model, prompt)
    tokens = cold["usage"]["prompt_tokens"]
    assert tokens > CHUNK and not (cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    full = (tokens - 1) // CHUNK * CHUNK  # vLLM computes the prompt's last token itself
    deadline = time.monotonic() + 120  # the saves finish after the answer
    while saved_chunks(held) - before < full // CHUNK * layers and time.monotonic() < deadline:
        time.sleep(0.5)
    assert saved_chunks(held) - before == full // CHUNK * layers, "the server's chunks never reached the pool"
    counted = kvpool_metrics(url)
    warm = complete(url, model, prompt, PREFETCH_HINT)  # as a router that wants the prefix in DRAM first
    metrics = {k: n - counted.get(k, 0) for k, n in kvpool_metrics(url).items()}  # the warm request's
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == full
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    # the connector's counts in the engine's own /metrics (vLLM's KVConnectorStats), beside its cached tokens
    assert metrics[("tokens", "loaded")] == full and metrics[("bytes", "load")] > 0
    assert metrics[("tokens", "hit")] >= full and metrics[("tokens", "lookup")] >= tokens  # vLLM may ask again
    assert not metrics.get(("errors", "load")) and not [k for k, n in metrics.items() if k[0] == "misses" and n]
    # the hint reached the scheduler through the server: one prefetch, which found the prefix in DRAM already
    assert metrics[("prefetches", "started")] == 1 and not metrics.get(("prefetches", "failed"))


@pytest.mark.timeout(600)
def test_kvpool_route_passes_requests_and_streams_to_the_engine(server: str, tmp_path: Path) -> None:
    """``kvpool route --upstream URL`` as a user starts it, in front of that server and of one that is down (a port
    nothing listens on, named first, so least-loaded picks it first): the engine's own answer, a streamed answer
    passed through chunk by chunk, the engine's model list, a body it cannot read refused, and its /metrics counting
    what went where: the dead upstream's refusals as its errors, every request answered by the live one.  (Its
    policies: tests/unit/test_route.py.)"""
    model, port, dead = converted_smollm2(), free_port(HOST), f"http://{HOST}:{free_port(HOST)}"
    kvpool = str(Path(sys.executable).with_name("kvpool"))
    args = [kvpool, "route", "--upstream", dead, "--upstream", server, "--host", HOST, "--port", str(port)]
    args += ["--policy", "least-loaded"]
    router = ServerProcess("kvpool route", args, tmp_path / "route.log")
    url = f"http://{HOST}:{port}"
    router.start(lambda: health(url), 120, KvPoolError, poll_s=0.5)
    try:
        prompt = "A pool of memory that outlives the engines: what does it keep, and for whom?"
        direct, routed = complete(server, model, prompt), complete(url, model, prompt)
        chunks = streamed(url, model, prompt)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as r:
            models = json.loads(r.read())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", b"not json"), timeout=60)
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
            metrics = r.read().decode()
    finally:
        router.stop()
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert len(chunks) > 1 and "".join(chunks) == direct["choices"][0]["text"]
    assert models["data"][0]["id"] == str(model) and refused.value.code == 400
    assert f'kvpool_route_requests_total{{upstream="{server}",policy="least-loaded"}} 2' in metrics
    refusals = re.findall(
        rf'^kvpool_route_errors_total{{upstream="{dead}",policy="least-loaded"}} (\d+)$', metrics, re.M
    )
    assert refusals and int(refusals[0]) >= 1


def streamed(url: str, model: Path, prompt: str) -> list[str]:
    """The text pieces of a streamed completion, as its server-sent events brought them."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    ask = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    pieces = []
    with urllib.request.urlopen(ask, timeout=300) as r:
        for line in r:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                pieces.append(json.loads(data)["choices"][0]["text"])
    return pieces


def kvpool_metrics(url: str) -> dict[tuple[str, str], float]:
    """``vllm:kvpool_<name>_total{..., <label>="<value>"} n`` of the server's /metrics as ``{(name, value): n}``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:kvpool_(\w+)_total\{(.*)\} (\S+)$", text, re.M)
    return {
        (name, re.findall(r'(?:kind|direction|cause|result|how)="(\w+)"', labels)[0]): float(n)
        for name, labels, n in found
    }


def test_the_sglang_line_carries_the_flags_sglang_config_prints(held: Held) -> None:
    """The SGLang server line beside vLLM's: SGLang's HiCache flags for the same pool, as ``kvpool sglang-config``
    prints them there (tests/integration/sglang/test_sglang_config_cli.py loads a working backend from such flags;
    tests/integration/sglang/test_launch_server.py runs the server on a GPU host)."""
    words = shlex.split(held.sglang_line)
    assert words[1:5] == ["-m", "sglang.launch_server", "--model-path", "MODEL"], held.sglang_line
    vllm_args = shlex.split(held.server_line.split("vllm-config ", 1)[1].removesuffix(')"'))
    kvpool = str(Path(sys.executable).with_name("kvpool"))
    env = {k: v for k, v in os.environ.items() if k not in (ENDPOINTS_ENV, "RAY_ADDRESS")} | {"COLUMNS": "400"}
    printed = after_exports(held, shlex.join([kvpool, "sglang-config", *vllm_args]), env)
    assert printed.returncode == 0, printed.stderr
    assert words[5:] == shlex.split(printed.stdout)
    extra = StorageConfig.from_extra(json.loads(words[9]))
    assert (extra.etcd, extra.cluster) == ((held.etcd,), held.cluster)
    assert f"RAY_AUTH_TOKEN_PATH={extra.ray_token_path} " in held.exports and extra.node_ip == HOST


def after_exports(held: Held, command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``command`` run in a shell with environment ``env`` after the export line ``held`` printed."""
    return subprocess.run(
        ["bash", "-c", f"{held.exports}; {command}"], capture_output=True, text=True, timeout=300, env=env
    )


def readme_block(heading: str) -> str:
    """The first Python block of the README's section ``heading``."""
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    section = readme.split(f"\n{heading}\n", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_the_readme_s_python_example_attaches_with_the_printed_line_alone(held: Held, tmp_path: Path) -> None:
    """The README's "Using the pool" block as a user's script, in a fresh shell whose environment is what any shell
    has (PATH, HOME) and the export line ``kvpool up --hold`` printed: nothing of this test's Ray or etcd."""
    script = tmp_path / "user.py"
    script.write_text(readme_block("## Using the pool"))
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
    for _ in range(2):  # the second run finds the chunks held and reads them back
        ran = after_exports(held, shlex.join([sys.executable, str(script)]), env)
        assert ran.returncode == 0, ran.stderr[-4000:]
