"""A vLLM engine in a process of its own, driven by JSON lines: what ``bench/vllm.py`` and the engine tests run.

``python -m kvpool.prefill_decode.vllm.engine '<settings>'`` starts an engine (``LLM``, in this process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so a connector's pool client lives here too), prints ``READY``, then answers
each JSON line on stdin with a line ``RESULT <json>``:

- ``{"generate": [[token ids], ...], "max_tokens": 8, "reset": false}`` → per prompt ``{"tokens", "logprobs",
  "cached", "seconds"}``: greedy tokens, their log-probabilities, vLLM's ``num_cached_tokens`` and the wall time of
  the whole call (with ``max_tokens`` 1, the time to first token).  ``reset`` first drops vLLM's own prefix cache,
  so a repeated prompt is served by the connector, not by the engine; ``"salts": ["key", ...]`` gives each prompt
  a ``cache_salt`` (with the connector's ``tenants``: a tenant's API key); ``"kv_transfer_params": {...}`` gives
  every prompt those (e.g. kvpool's prefetch hint, :mod:`~kvpool.prefill_decode.vllm.hint`);
- ``{"connector": true}`` → kvpool's worker-side connector: its running ``totals``, its cache ``identity``, its
  ``layers`` and the pool ``node`` its client is on ("" until it has connected);
- ``{"quit": true}`` → ends the process (queued saves finish first).

Settings: ``model`` (a directory), ``connector`` (kvpool's ``kv_connector_extra_config``; with ``role``) or
``kv_transfer`` (any vLLM ``KVTransferConfig``, e.g. vLLM's own connectors), ``max_model_len``, ``block_size``,
``dtype`` (default float32), ``attention_backend`` (a vLLM backend name, e.g. ``CPU_MLA``; default: vLLM picks, see
:mod:`~kvpool.prefill_decode.vllm.cpu_backends`),
``prefix_caching`` (false: vLLM's own prefix cache off, as Mamba hybrids need on CPU),
``kv_events`` (``{"endpoint", "topic"}``: vLLM publishes its prefix cache's block events there, see
:mod:`~kvpool.prefill_decode.routing.engine_router`).
:class:`EngineProcess` runs one from Python.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Protocol, TextIO

from msgspec.structs import asdict

from kvpool.errors import ConfigError, WorkerUnavailable

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def start_engine(settings: dict[str, Any]) -> Any:
    """An ``LLM`` for ``settings`` (see the module's docstring); CPU-friendly defaults, token-id prompts."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvpool.prefill_decode.vllm.config import ConnectorConfig, kv_transfer_config

    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    kw: dict[str, Any] = {}
    if settings.get("connector") is not None:
        config = ConnectorConfig.from_extra(settings["connector"])
        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(config, settings.get("role", "kv_both")))
    elif settings.get("kv_transfer") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**settings["kv_transfer"])
    if settings.get("prefix_caching") is False:
        kw["enable_prefix_caching"] = False
    if settings.get("attention_backend"):
        kw["attention_backend"] = settings["attention_backend"]
    if settings.get("kv_events"):  # vLLM publishes its prefix cache's blocks there (what a router tracks)
        from vllm.config import KVEventsConfig

        events = settings["kv_events"]
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events["endpoint"], topic=events.get("topic", "")
        )
    return LLM(
        model=settings["model"],
        skip_tokenizer_init=True,
        dtype=settings.get("dtype", "float32"),
        block_size=settings.get("block_size", 32),
        max_model_len=settings.get("max_model_len", 4096),
        enforce_eager=True,
        seed=0,
        **kw,
    )


def generate(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int = 8,
    reset: bool = False,
    salts: list[str] | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Greedy completions of token-id prompts (see the module's docstring); ``salts``: each prompt's ``cache_salt``
    ("" for none); ``kv_transfer_params``: every request's (as the OpenAI server passes a request body's)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if reset:
        _reset_prefix_cache(llm)
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, logprobs=0, extra_args=extra)
    started = time.perf_counter()
    asked = [
        TokensPrompt(prompt_token_ids=p, cache_salt=s) if s else TokensPrompt(prompt_token_ids=p)
        for p, s in zip(prompts, salts or [""] * len(prompts), strict=True)
    ]
    outs = llm.generate(asked, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)],
            "cached": o.num_cached_tokens,
            "seconds": seconds,
        }
        for o in outs
    ]


def _reset_prefix_cache(llm: Any, timeout_s: float = 60.0) -> None:
    """Empty vLLM's own prefix cache.  vLLM refuses while a block is held, and the connector holds a finished
    request's blocks until a step of the engine hears that their saves are done: one-token requests step it until
    then (``WorkerUnavailable`` after ``timeout_s``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise WorkerUnavailable(f"vLLM's prefix cache still holds blocks after {timeout_s:.0f} s of saves")
        time.sleep(0.05)
        llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(max_tokens=1), use_tqdm=False)


def connector_state() -> dict[str, Any]:
    """kvpool's worker-side connector in this process: its running totals and cache identity."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().side
    client = side.client
    return {
        "totals": dict(side.counts.totals),
        "identity": asdict(side.identity),
        "layers": len(side.layers),
        "node": client.node_id if client is not None else "",
    }


class Forker(Protocol):
    """What forks engines from a process that imported vLLM already (:class:`~kvpool.prefill_decode.vllm.zygote.Zygote`)."""

    def serves(self, env: dict[str, str]) -> bool:
        """Whether an engine with environment ``env`` can be forked."""
        ...

    def spawn(self, settings: dict[str, Any], env: dict[str, str], stderr: IO[str]) -> Any:
        """A process running :func:`serve` for ``settings``, as :class:`subprocess.Popen` would give it."""
        ...


class EngineProcess:
    """An engine in its own process, answering one command at a time; its stderr goes to ``log``.  ``zygote``: fork
    it from that process, which imported vLLM already, where it can."""

    def __init__(
        self, settings: dict[str, Any], log: Path, env: dict[str, str] | None = None, zygote: Forker | None = None
    ) -> None:
        self.log = log
        self._log: TextIO = log.open("w")
        full_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        self.proc: Any
        if zygote is not None and zygote.serves(full_env):
            self.proc = zygote.spawn(settings, full_env, self._log)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, json.dumps(settings)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                env=full_env,
            )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        code = self.proc.wait()
        self._log.flush()
        raise WorkerUnavailable(
            f"engine exited ({code}) before {prefix.strip()}; its log:\n{self.log.read_text()[-6000:]}"
        )

    def ask(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self._expect("RESULT "))
        if isinstance(answer, dict) and "error" in answer:  # the engine refused the command and goes on
            kind = ConfigError if answer.get("kind") == "input" else WorkerUnavailable
            raise kind(f"the engine refused the request: {answer['error']}")
        return answer

    def generate(
        self,
        prompts: list[list[int]],
        reset: bool = False,
        max_tokens: int = 8,
        salts: list[str] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        return self.ask(
            generate=prompts, reset=reset, max_tokens=max_tokens, salts=salts, kv_transfer_params=kv_transfer_params
        )

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def preload() -> None:
    """Import what an engine uses (``zygote.py`` forks engines after it)."""
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: F401
    from vllm.exceptions import VLLMClientError  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401


def serve(settings: dict[str, Any]) -> None:
    """Start an engine for ``settings`` and answer stdin's commands (see the module's docstring)."""
    from vllm.exceptions import VLLMClientError  # what vLLM raises for a request it will not serve (too long, ...)

    bad_input = (ValueError, TypeError, VLLMClientError)
    llm = start_engine(settings)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        try:
            if cmd.get("connector"):
                answer: Any = connector_state()
            else:
                args = (cmd.get("max_tokens", 8), cmd.get("reset", False), cmd.get("salts"))
                answer = generate(llm, cmd["generate"], *args, cmd.get("kv_transfer_params"))
        except Exception as exc:  # a bad prompt (too long, a token outside the vocabulary): say so, go on
            kind = "input" if isinstance(exc, bad_input) else "engine"
            answer = {"error": f"{type(exc).__name__}: {exc}"[:2000], "kind": kind}
        print("RESULT " + json.dumps(answer), flush=True)


def main() -> None:
    serve(json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
