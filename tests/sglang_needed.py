"""SGLang for the tests that run its classes: skipped where it is not installed, except under ``make test`` (which
installs it and sets ``KVPOOL_REQUIRE_SGLANG=1``), where a missing or broken SGLang fails the suite instead.  On CPU
hosts torchvision, which sglang imports, lives outside the venv's site-packages (see
:mod:`kvpool.prefill_decode.sglang.cpu_import`): only the processes that import SGLang this way see it."""

import os
from types import ModuleType

import pytest

from kvpool.prefill_decode.sglang.cpu_import import import_sglang

REQUIRED = os.environ.get("KVPOOL_REQUIRE_SGLANG") == "1"


def sglang_module(name: str = "sglang") -> ModuleType:
    """``name`` (SGLang or one of its modules), imported; a skip where SGLang is optional, an error where not."""
    if REQUIRED:
        return import_sglang(name)
    try:
        return import_sglang(name)
    except ImportError as exc:
        pytest.skip(f"the SGLang tests need sglang (make installs it): {exc}")
