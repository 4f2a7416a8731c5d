"""A vLLM engine (CPU) in a process of its own, driven line by line: the engine side of the connector tests.

Run as ``python engine_proc.py '<json settings>'``; then each line on stdin is a JSON command and each answer a
line ``RESULT <json>`` on stdout:

- ``{"generate": [[token ids], ...], "max_tokens": 8, "reset": false}`` → per prompt ``{"tokens", "logprobs",
  "cached"}`` (greedy; ``cached`` is vLLM's ``num_cached_tokens``); ``reset`` first drops vLLM's own prefix cache,
  so a repeated prompt is served from the pool, not from the engine;
- ``{"connector": true}`` → the worker-side connector's running ``totals`` (tokens and bytes loaded and saved,
  errors) and its cache ``identity``;
- ``{"quit": true}`` → ends the process (queued saves finish first).

Settings: ``model`` (a directory), ``connector`` (``kv_connector_extra_config``, or null for no connector), ``role``.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the connector's pool client is here too.
"""

import json
import os
import sys
from dataclasses import asdict

for name, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
}.items():  # fmt: skip
    os.environ.setdefault(name, value)


def engine(settings: dict) -> object:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if settings.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvPoolConnector", kv_connector_module_path="kvpool.prefill_decode.vllm_connector",
            kv_role=settings.get("role", "kv_both"), kv_connector_extra_config=settings["connector"],
        )  # fmt: skip
    return LLM(
        model=settings["model"], skip_tokenizer_init=True, dtype="float32", block_size=32, max_model_len=4096,
        enforce_eager=True, seed=0, **kw,
    )  # fmt: skip


def main() -> None:
    llm = engine(json.loads(sys.argv[1]))
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("connector"):
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            side = get_kv_transfer_group().side
            print("RESULT " + json.dumps({"totals": side.totals, "identity": asdict(side.identity)}), flush=True)
            continue
        print(
            "RESULT " + json.dumps(generate(llm, cmd["generate"], cmd.get("max_tokens", 8), cmd.get("reset"))),
            flush=True,
        )


def generate(llm: object, prompts: list[list[int]], max_tokens: int = 8, reset: bool = False) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if reset:
        llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)],
            "cached": o.num_cached_tokens,
        }
        for o in outs
    ]


if __name__ == "__main__":
    main()
