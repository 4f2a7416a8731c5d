"""The options the serving benches share (``bench/serve.py``, ``bench/chaos.py``): how the trace is scaled to this
machine and what the engines are."""

import argparse
from collections.abc import Callable
from pathlib import Path

from kvpool.bench.workloads.mooncake import TRACES


def names(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An option's parser: names of ``known``, comma-separated."""

    def parse(text: str) -> list[str]:
        given = [w for w in text.split(",") if w]
        if not given or set(given) - set(known):
            raise argparse.ArgumentTypeError(f"name some of {', '.join(known)}, comma-separated")
        return given

    return parse


def scale_options(ap: argparse.ArgumentParser) -> None:
    """The trace's scaling (``bench/serve.py``'s docstring) and the engines' settings."""
    ap.add_argument("--trace", choices=sorted(TRACES), default="conversation")
    ap.add_argument("--sample", type=int, default=300, help="one conversation in N (by its second block's hash id)")
    ap.add_argument("--requests", type=int, default=30, help="the sample's first N requests")
    ap.add_argument("--hash-block", type=int, default=32, help="tokens a hash id stands for (512 in the trace)")
    ap.add_argument("--max-input", type=int, default=768, help="prompt tokens at most")
    ap.add_argument("--max-output", type=int, default=8, help="output tokens of every request")
    ap.add_argument("--speedup", type=float, default=20.0, help="the trace's time compressed this many times")
    ap.add_argument("--engines", type=int, default=2, help="vLLM engines (one per Ray node)")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="the engines' (vLLM's CPU default is bfloat16, which CPUs without AVX-512 BF16 or AMX emulate slowly)",
    )
    ap.add_argument(
        "--bind-cores", action="store_true", help="engine i computes on core i alone (engines on separate hosts)"
    )
    ap.add_argument("--engine-blocks", type=int, default=64, help="KV blocks (32 tokens) of each engine's own cache")
    ap.add_argument(
        "--kvpool-chunk", type=int, default=256, help="tokens a kvpool chunk holds (the connector's default; x 32)"
    )
    ap.add_argument(
        "--kvpool-layerwise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kvpool loads layer by layer as the forward goes (the connector's default), or all layers before it",
    )
    ap.add_argument("--pool-mib", type=int, default=512, help="memory of the layer below, per engine (MiB)")
    ap.add_argument("--model", type=Path, help="a vLLM model directory with its tokenizer (default: SmolLM2-135M)")
