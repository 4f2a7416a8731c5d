"""The module path users name in ``--kv-transfer-config`` (``"kv_connector_module_path":
"kvpool.prefill_decode.vllm_connector"``, as ``kvpool vllm-config`` prints it): vLLM's connector lives in
:mod:`kvpool.prefill_decode.vllm.connector`; this path stays for the configs that name it."""

from kvpool.prefill_decode.vllm.connector import KvPoolConnector

__all__ = ["KvPoolConnector"]
