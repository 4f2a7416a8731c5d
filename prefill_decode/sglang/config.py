"""What an SGLang server needs to use the pool as its HiCache L3 tier: ``--hicache-storage-backend-extra-config``
validated (:class:`StorageConfig`) and the flags that switch it on (:func:`server_flags`).  No SGLang import here:
``kvpool sglang-config`` runs where SGLang is not installed, e.g. on the pool's head node."""

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvpool.core.config import Rule
from kvpool.prefill_decode.connector_core.settings import PoolSettings

MODULE = "kvpool.prefill_decode.sglang.storage"
CLASS = "KvPoolStorage"
BACKEND = "kvpool"
_WHERE = "hicache-storage-backend-extra-config"
#: the keys SGLang itself may leave in the extra config it hands a backend (``file_storage_path``: added when the
#: server has ``--file-storage-path``); they are not this backend's and are not checked
SGLANG_KEYS = ("file_storage_path", "tp_lcm_size")


class StorageConfig(PoolSettings, frozen=True):
    """``--hicache-storage-backend-extra-config``, validated (:meth:`from_extra`); unknown keys are refused.  The
    first four are the ``dynamic`` factory's: it loads ``module_path``'s ``class_name``, and with ``interface_v1``
    the controller moves pages through ``batch_set_v1``/``batch_get_v1`` (without: ``batch_set``/``batch_get``)."""

    backend_name: Annotated[str, Meta(min_length=1)] = BACKEND
    module_path: Annotated[str, Meta(min_length=1)] = MODULE
    class_name: Annotated[str, Meta(min_length=1)] = CLASS
    interface_v1: Annotated[int, Meta(ge=0, le=1, description="1 (zero-copy batch_*_v1 calls) or 0")] = 1
    #: the tenant whose chain and quota this server's pages use (a name in ``tenants``); "": none
    tenant: str = ""

    rules = (
        Rule(
            "together",
            "tenants",
            "tenant",
            "with a tenants file (tenants=PATH), name the tenant this server's pages are for (tenant=NAME)",
        ),
    )

    @classmethod
    def from_extra(cls, extra: Any, where: str = _WHERE) -> "StorageConfig":
        """SGLang's extra config for the backend (a JSON object), checked; the keys SGLang adds itself are left out."""
        if isinstance(extra, dict):
            extra = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
        config: StorageConfig = super().from_extra(extra, where)
        return config


def extra_config(config: StorageConfig) -> dict[str, Any]:
    """The extra config for ``config``: the factory's four keys, and the pool's settings that differ from their
    defaults."""
    defaults = StorageConfig()
    always = ("backend_name", "module_path", "class_name", "interface_v1")
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in msgspec.structs.asdict(config).items()
        if k in always or v != getattr(defaults, k)
    }


def server_flags(config: StorageConfig) -> list[str]:
    """The ``python -m sglang.launch_server`` flags that make the pool the server's HiCache L3 tier."""
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra_config(config), separators=(",", ":")),
    ]
