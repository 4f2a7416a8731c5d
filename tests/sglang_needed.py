"""SGLang for the tests that run its classes: skipped where it is not installed, except under ``make test`` (which
installs it and sets ``KVPOOL_REQUIRE_SGLANG=1``), where a missing or broken SGLang fails the suite instead.

On CPU hosts the Makefile keeps torchvision (which sglang imports at import time) out of the venv's site-packages, in
``<venv>/sglang-torchvision``: PyPI's build links libtorch_cuda, so beside CPU torch its C ops do not load, and
transformers (hence vLLM) would fail on it.  :func:`sglang_module` puts that folder on ``sys.path`` of the SGLang
tests' processes only, and gives torchvision's two missing ops a schema so that its Python part imports (nothing on
SGLang's storage path calls them).  With a CUDA torch, where torchvision imports cleanly, it does nothing."""

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

REQUIRED = os.environ.get("KVPOOL_REQUIRE_SGLANG") == "1"
TORCHVISION = Path(sys.prefix) / "sglang-torchvision"  #: where the Makefile puts torchvision (see above)
_ops: object = None  #: the op schemas, kept alive for the process


def _torchvision() -> None:
    """Make ``import torchvision`` work beside a CPU torch (see the module's docstring)."""
    global _ops
    if TORCHVISION.is_dir() and str(TORCHVISION) not in sys.path:
        sys.path.append(str(TORCHVISION))
    try:
        import torchvision
    except RuntimeError as exc:  # its C ops did not load: "operator torchvision::nms does not exist"
        if "torchvision::" not in str(exc):
            raise
        import torch

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _ops = lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision  # noqa: F401
    except ImportError:
        pass  # sglang's own import then says what is missing


def sglang_module(name: str = "sglang") -> ModuleType:
    """``name`` (SGLang or one of its modules), imported; a skip where SGLang is optional, an error where not."""
    _torchvision()
    if REQUIRED:
        return importlib.import_module(name)
    return pytest.importorskip(name, reason="the SGLang tests need sglang (make installs it)")
