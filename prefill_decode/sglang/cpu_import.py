"""SGLang importable beside a CPU torch: on CPU hosts the Makefile keeps torchvision (which sglang imports at import
time) out of the venv's site-packages, in ``<venv>/sglang-torchvision``: PyPI's build links libtorch_cuda, so beside
CPU torch its C ops do not load, and transformers (hence vLLM) would fail on it.  :func:`import_sglang` puts that
folder on ``sys.path`` of the process that asks (SGLang's tests, ``bench/sglang.py``; never a vLLM process) and gives
torchvision's two missing ops a schema so that its Python part imports (nothing on SGLang's storage path calls them).
With a CUDA torch, where torchvision imports cleanly, it only imports the module asked for.  :func:`tp_group` is the
one-rank TP group SGLang's cache controller needs where no SGLang scheduler set one up (the tests, the bench)."""

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from kvpool.core.net import free_port

TORCHVISION = Path(sys.prefix) / "sglang-torchvision"  #: where the Makefile puts torchvision (see above)
_ops: object = None  #: the op schemas, kept alive for the process


def _torchvision() -> None:
    """Make ``import torchvision`` work beside a CPU torch (see the module's docstring)."""
    global _ops
    if TORCHVISION.is_dir() and str(TORCHVISION) not in sys.path:
        sys.path.append(str(TORCHVISION))
    try:
        importlib.import_module("torchvision")
    except RuntimeError as exc:  # its C ops did not load: "operator torchvision::nms does not exist"
        if "torchvision::" not in str(exc):
            raise
        import torch

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _ops = lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        importlib.import_module("torchvision")
    except ImportError:
        pass  # sglang's own import then says what is missing


def import_sglang(name: str = "sglang") -> ModuleType:
    """``name`` (SGLang or one of its modules), imported with torchvision made importable first; ``ImportError``
    where SGLang is not installed."""
    _torchvision()
    return importlib.import_module(name)


def tp_group() -> Any:
    """SGLang's TP group of one rank (gloo on loopback), as its scheduler sets it up; once a process."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        port = free_port("127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    return dist.new_group([0], backend="gloo")
