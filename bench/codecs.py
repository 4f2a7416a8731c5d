"""KV codecs: compression ratio, encode/decode GB/s beside memcpy, and what each codec does to a real model.

No pool, no Ray: the codecs of ``kvpool.pool.tiers.codecs`` alone, on real KV.  For each model -- the random-weight 8-layer
tiny Llama on random tokens, and SmolLM2-135M on real text (the ``kvpool up`` demo's document and question, in its
chat template) -- one prefill gives the prompt's cache.  Its K and V are cut the way the pool stores them: per layer,
token-major objects ``[T, 2, H, D]`` of ``--chunk`` tokens (the last one shorter).  Then, per codec:

- ratio: bytes of the objects / bytes encoded (headers included);
- encode / decode GB/s: object bytes per second, one object at a time, one thread (``--threads``), the fastest of
  ``--repeat`` passes; beside them memcpy GB/s: the same objects cloned (allocate and copy, the least a decode has
  to do), the physical limit;
- seal / open GB/s: encryption at rest (``pool/tiers/crypto.py``, AES-256-GCM with a per-chunk derived key) of the
  codec's output, as an encrypted tier adds it after the codec: bytes sealed (the encoded bytes) per second, the
  same way (one object at a time, one thread, fastest pass);
- KV error: ``||decoded - original|| / ||original||`` over the whole cache;
- the model: every object encoded and decoded and the cache rebuilt from them, then ``--steps`` greedy decode steps
  compared with the same steps from the original cache: max |logit difference| with both fed the original's tokens
  (teacher-forced), the share of those steps whose top token still agrees, and, decoding freely, how many of the
  generated tokens equal the original's and the first step at which they part.

A second table checks the CacheGen-style delta stage: zstd alone against token-wise delta + zstd, on the codes of each
base quantizer, for the same objects.  ``+delta+zstd`` is offered for int4 only because that is where it wins.
Ratios are against the model's KV dtype (``--dtype``, float32 by default, as the models run here on CPU): against a
16-bit cache the lossy codecs' ratios halve.  About three minutes on 2 cores, most of it SmolLM2's decode steps.

    python bench/codecs.py [--models tiny-llama,smollm2-135m] [--codecs raw,int4+zstd] [--steps 32] [--repeat 5]
"""

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache

from kvpool.pool.tiers.codecs import Codec, parse_codec
from kvpool.pool.tiers.crypto import KEY_BYTES, Keyring
from kvpool.pool.tiers.lossless import ZSTD_LEVEL
from kvpool.pool.tiers.quantizers import Int4, Quantizer
from kvpool.prefill_decode.reference.demo import demo_prompt
from kvpool.prefill_decode.reference.model import LoadedModel, forward, kv_cache, load_model

console = Console(width=170)

CODECS = (
    "raw",
    "raw+zstd",
    "fp8-e4m3",
    "fp8-e4m3/channel",
    "fp8-e5m2",
    "fp8-e5m2/channel",
    "fp8-e4m3+zstd",
    "fp8-e4m3/channel+zstd",
    "fp8-e5m2+zstd",
    "int4",
    "int4:g64",
    "int4+zstd",
    "int4+delta+zstd",
    "int4:g64+zstd",
    "int4:g64+delta+zstd",
)
DELTA_BASES = ("raw", "fp8-e4m3", "fp8-e4m3/channel", "fp8-e5m2", "int4", "int4:g64")


def prompt_ids(loaded: LoadedModel, tiny_tokens: int) -> torch.Tensor:
    """``[1, N]`` prompt ids: the demo's chat for a model with a tokenizer, seeded random tokens otherwise."""
    if loaded.tokenizer is None:
        vocab = loaded.model.config.vocab_size
        return torch.randint(0, vocab, (1, tiny_tokens), generator=torch.Generator().manual_seed(0))
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": demo_prompt()}], add_generation_prompt=True, tokenize=False
    )
    return torch.tensor([loaded.tokenizer.encode(text, add_special_tokens=False)])


def to_objects(cache: Any, chunk: int) -> list[list[torch.Tensor]]:
    """Per layer, the pool objects of a cache: ``[T, 2, H, D]`` slices of ``chunk`` tokens (the last may be short)."""
    objects = []
    for layer in cache.layers:
        kv = torch.stack([layer.keys[0], layer.values[0]]).permute(2, 0, 1, 3)  # [N, 2, H, D]
        objects.append([kv[s : s + chunk].contiguous() for s in range(0, kv.shape[0], chunk)])
    return objects


def to_cache(objects: list[list[torch.Tensor]]) -> DynamicCache:
    """A fresh cache (batch of one) from per-layer objects."""
    cache = DynamicCache()
    for index, pieces in enumerate(objects):
        kv = torch.cat(pieces).permute(1, 2, 0, 3).unsqueeze(1)  # [2, 1, H, N, D]
        cache.update(kv[0].contiguous(), kv[1].contiguous(), index)
    return cache


@torch.no_grad()
def greedy(
    loaded: LoadedModel, objects: list[list[torch.Tensor]], first: int, steps: int, forced: Sequence[int] = ()
) -> tuple[list[int], torch.Tensor]:
    """``steps`` decode steps from a cache rebuilt from ``objects``, starting with token ``first``: the tokens chosen
    and the logits ``[steps, vocab]``.  With ``forced``, step ``i`` is fed ``forced[i]`` instead of the last choice."""
    cache = to_cache(objects)
    token, tokens, logits = first, [], []
    for i in range(steps):
        ids = torch.tensor([[forced[i] if forced else token]], device=loaded.device)
        out = forward(loaded.model, ids, cache).logits[0, -1].float()
        token = int(out.argmax())
        tokens.append(token)
        logits.append(out)
    return tokens, torch.stack(logits)


def pass_seconds(fn: Callable[[Any], object], items: Sequence[Any], repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` passes of ``fn`` over ``items``, each result dropped at once (as a tier
    would).  The fastest, not the median: on a shared 2-core machine it is the pass least disturbed by others."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        runs.append(time.perf_counter() - t0)
    return min(runs)


def _fidelity(
    loaded: LoadedModel,
    objects: list[list[torch.Tensor]],
    decoded: list[torch.Tensor],
    first: int,
    ref: list[int],
    logits: torch.Tensor,
) -> dict[str, Any]:
    """How far the model strays on ``decoded`` (a codec's round trip of ``objects``, flattened) from the original's
    greedy tokens ``ref`` and their ``logits``: the KV's relative error, the largest logit error with the original's
    tokens forced, the share of forced top-1 choices kept, and the free-running tokens kept (up to the first change)."""
    flat = [o for layer in objects for o in layer]
    err = torch.stack([(d.float() - o.float()).pow(2).sum() for d, o in zip(decoded, flat, strict=True)]).sum()
    norm = torch.stack([o.float().pow(2).sum() for o in flat]).sum()
    it = iter(decoded)
    coded = [[next(it) for _ in layer] for layer in objects]
    steps = len(ref)
    forced_tokens, forced_logits = greedy(loaded, coded, first, steps, forced=[first, *ref[:-1]])
    free_tokens, _ = greedy(loaded, coded, first, steps)
    same = [a == b for a, b in zip(free_tokens, ref, strict=True)]
    return {
        "kv_rel_err": float((err / norm).sqrt()) if norm > 0 else 0.0,
        "max_logit_err": float((forced_logits - logits).abs().max()),
        "forced_top1_agree": sum(a == b for a, b in zip(forced_tokens, ref, strict=True)) / steps,
        "free_tokens_same": sum(same),
        "first_diff": same.index(False) + 1 if False in same else None,
        "steps": steps,
    }


def bench_model(args: argparse.Namespace, name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    loaded = load_model(name, dtype=getattr(torch, args.dtype))
    ids = prompt_ids(loaded, args.tiny_tokens)
    with torch.no_grad():
        out = loaded.model(ids, use_cache=True, logits_to_keep=1)
    objects = to_objects(kv_cache(out), args.chunk)
    flat = [o for layer in objects for o in layer]
    nbytes = sum(o.numel() * o.element_size() for o in flat)
    first = int(out.logits[0, -1].argmax())
    ref_tokens, ref_logits = greedy(loaded, objects, first, args.steps)
    top2 = ref_logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())  # how close the original's greedy choices were to a tie
    text = "" if loaded.tokenizer is None else f": {loaded.tokenizer.decode([first, *ref_tokens])!r}"
    console.print(
        f"[bold]{loaded.name}[/]: {ids.shape[1]} prompt tokens, {len(flat)} objects of up to {list(flat[0].shape)} "
        f"{args.dtype} ({nbytes / 2**20:.1f} MiB); logits span {float(ref_logits.min()):.1f}.."
        f"{float(ref_logits.max()):.1f}, "
        f"smallest top-1 margin over the {args.steps} steps {margin:.2f}; original greedy continuation{text}"
    )
    copy_s = pass_seconds(torch.Tensor.clone, flat, args.repeat)
    keyring, chunk_key = Keyring({"bench": os.urandom(KEY_BYTES)}), os.urandom(32)
    rows = []
    for spec in args.codecs:
        codec = parse_codec(spec)
        encoded = [codec.encode(o) for o in flat]
        encode_s = pass_seconds(codec.encode, flat, args.repeat)
        decode_s = pass_seconds(codec.decode, encoded, args.repeat)
        sealed = [keyring.seal(b, chunk_key, codec.name) for b in encoded]
        seal_s = pass_seconds(lambda b: keyring.seal(b, chunk_key, codec.name), encoded, args.repeat)  # noqa: B023
        open_s = pass_seconds(lambda b: keyring.open(b, chunk_key, codec.name), sealed, args.repeat)  # noqa: B023
        rows.append(
            {
                "model": name,
                "codec": codec.name,
                "dtype": args.dtype,
                "objects": len(flat),
                "object_shape": list(flat[0].shape),
                "bytes": nbytes,
                "encoded_bytes": sum(map(len, encoded)),
                "ratio": nbytes / sum(map(len, encoded)),
                "encode_gbps": nbytes / encode_s / 1e9,
                "decode_gbps": nbytes / decode_s / 1e9,
                "memcpy_gbps": nbytes / copy_s / 1e9,
                "object_bytes": flat[0].numel() * flat[0].element_size(),
                "seal_gbps": sum(map(len, encoded)) / seal_s / 1e9,
                "open_gbps": sum(map(len, encoded)) / open_s / 1e9,
                **_fidelity(loaded, objects, [codec.decode(b) for b in encoded], first, ref_tokens, ref_logits),
                "ref_min_margin": margin,
            }
        )
        r = rows[-1]
        console.print(
            f"  {codec.name:24} {r['ratio']:5.2f}x  enc {r['encode_gbps']:.2f} dec {r['decode_gbps']:.2f} "
            f"seal {r['seal_gbps']:.2f} open {r['open_gbps']:.2f} GB/s  "
            f"max|dlogit| {r['max_logit_err']:.3f}  tokens {r['free_tokens_same']}/{args.steps}"
        )
    return rows, delta_rows(name, flat, nbytes)


def delta_rows(model: str, objects: list[torch.Tensor], nbytes: int) -> list[dict[str, Any]]:
    """zstd alone vs token-wise delta then zstd, on each base quantizer's codes (the codec's own stages, written
    out here so that every base can be tried, not only the one the codec allows)."""
    zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    rows = []
    for spec in DELTA_BASES:
        q = parse_codec(spec).quantizer
        plain = delta = 0
        for o in objects:
            params, codes = q.quantize(o)
            plain += len(zstd.compress(params + stored(q, codes)))
            delta += len(zstd.compress(params + stored(q, token_delta(codes, q.bits(o.dtype)))))
        codec_bytes = None
        if isinstance(q, Int4):
            with_delta = Codec(q, delta=True, zstd=True)
            codec_bytes = sum(len(with_delta.encode(o)) for o in objects)
        rows.append(
            {
                "model": model,
                "base": spec,
                "zstd_ratio": nbytes / plain,
                "delta_zstd_ratio": nbytes / delta,
                "delta_gain": plain / delta - 1,
                "codec_delta_ratio": nbytes / codec_bytes if codec_bytes else None,
            }
        )
    return rows


def token_delta(codes: np.ndarray, bits: int) -> np.ndarray:
    """Each token's code words minus the previous token's, modulo ``2**bits`` (codes are ``[T, words]``)."""
    out = codes.copy()
    np.subtract(codes[1:], codes[:-1], out=out[1:])
    return out & ((1 << bits) - 1) if bits < 8 else out


def stored(q: Quantizer, codes: np.ndarray) -> bytes:
    """The codes as the zstd stage sees them: packed, multi-byte words split into byte planes."""
    packed = q.pack(codes).reshape(-1)
    if packed.itemsize > 1:
        packed = np.ascontiguousarray(packed.view(np.uint8).reshape(-1, packed.itemsize).T)
    return packed.tobytes()


def render(rows: list[dict[str, Any]], deltas: list[dict[str, Any]], steps: int) -> None:
    table = Table(title=f"KV codecs: size, speed (one thread) and the effect on {steps} greedy decode steps")
    cols = (
        "model",
        "codec",
        "ratio",
        "encode GB/s",
        "decode GB/s",
        "memcpy GB/s",
        "seal GB/s",
        "open GB/s",
        "KV rel err",
        "max |Δlogit|",
        "top-1 agree (forced)",
        "same tokens (free)",
        "first diff",
    )
    for col in cols:
        left = col in ("model", "codec")
        table.add_column(col, justify="left" if left else "right", no_wrap=left)
    for i, r in enumerate(rows):
        table.add_row(
            r["model"],
            r["codec"],
            f"{r['ratio']:.2f}x",
            f"{r['encode_gbps']:.2f}",
            f"{r['decode_gbps']:.2f}",
            f"{r['memcpy_gbps']:.1f}",
            f"{r['seal_gbps']:.2f}",
            f"{r['open_gbps']:.2f}",
            f"{r['kv_rel_err']:.4f}",
            f"{r['max_logit_err']:.3f}",
            f"{r['forced_top1_agree']:.0%}",
            f"{r['free_tokens_same']}/{r['steps']}",
            "-" if r["first_diff"] is None else str(r["first_diff"]),
            end_section=i + 1 < len(rows) and rows[i + 1]["model"] != r["model"],
        )
    console.print(table)
    console.print(
        "ratio: object bytes / encoded bytes, headers included; GB/s: object bytes per second; memcpy: the same "
        "objects cloned, the floor for any decode; seal / open: AES-256-GCM of the encoded bytes (encryption at rest, "
        "after the codec), bytes sealed per second; max |Δlogit| and top-1 agree: the codec'd cache fed the "
        "original's tokens; same tokens: free greedy decoding, positions equal to the original's; first diff: the "
        "first step that differs (- for none)."
    )
    _render_deltas(deltas)


def _render_deltas(deltas: list[dict[str, Any]]) -> None:
    dt = Table(title="CacheGen-style token-wise delta before zstd, per base quantizer (compression ratios)")
    for col in ("model", "base", "+zstd", "+delta+zstd", "delta gain", "codec int4+delta+zstd"):
        dt.add_column(col, justify="left" if col in ("model", "base") else "right")
    for i, r in enumerate(deltas):
        dt.add_row(
            r["model"],
            r["base"],
            f"{r['zstd_ratio']:.3f}x",
            f"{r['delta_zstd_ratio']:.3f}x",
            f"{r['delta_gain']:+.1%}",
            "" if r["codec_delta_ratio"] is None else f"{r['codec_delta_ratio']:.3f}x",
            end_section=i + 1 < len(deltas) and deltas[i + 1]["model"] != r["model"],
        )
    console.print(dt)
    console.print(
        "codec int4+delta+zstd: the codec's own encoded size (headers included), as a check of the column before."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-llama,smollm2-135m", help="comma-separated: tiny-llama, smollm2-135m")
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec specs")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per pool object")
    ap.add_argument("--tiny-tokens", type=int, default=1024, help="prompt tokens for the tiny Llama (random ids)")
    ap.add_argument("--steps", type=int, default=32, help="greedy decode steps compared")
    ap.add_argument("--repeat", type=int, default=5, help="timed passes per figure; the fastest is reported")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model and KV dtype")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (codec figures are for this many)")
    ap.add_argument("--json", default="bench/results/codecs.json", help="where to write the figures")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.codecs = [s for s in args.codecs.split(",") if s]
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    deltas: list[dict[str, Any]] = []
    for name in args.models.split(","):
        model_rows, model_deltas = bench_model(args, name)
        rows += model_rows
        deltas += model_deltas
    render(rows, deltas, args.steps)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"codecs": rows, "delta": deltas}, indent=2))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
