"""What a vLLM engine needs to use the pool: ``kv_connector_extra_config`` validated (:class:`ConnectorConfig`) and
the whole ``--kv-transfer-config`` (:func:`kv_transfer_config`).  No vLLM import here: ``kvpool vllm-config`` runs
where vLLM is not installed, e.g. on the pool's head node."""

import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvpool.core.config import Positive, Seconds, validated
from kvpool.core.keys import DEFAULT_CHUNK_SIZE
from kvpool.prefill_decode.connector_core.settings import PoolSettings

#: vLLM's kv_role: an engine that saves and loads, one that saves (prefill) or one that loads (decode)
Role = Literal["kv_both", "kv_producer", "kv_consumer"]
ROLES: tuple[str, ...] = typing.get_args(Role)
_Role = Annotated[Role, Meta(description=f"one of {', '.join(ROLES)}")]
CONNECTOR = "KvPoolConnector"
MODULE = "kvpool.prefill_decode.vllm_connector"
_WHERE = "kv_connector_extra_config"


class ConnectorConfig(PoolSettings, frozen=True):
    """``kv_connector_extra_config``, validated (:meth:`from_extra`); unknown keys are refused.  The pool's settings
    are :class:`PoolSettings`' (``model_id`` empty: vLLM's served model name; with ``tenants``, a request's
    ``cache_salt`` must be a tenant's API key, its chunks are keyed in that tenant's chain, and a request without one
    is served without the pool)."""

    chunk_size: Positive = DEFAULT_CHUNK_SIZE  #: tokens per chunk: a multiple of vLLM's block size
    #: vLLM's kv_load_failure_policy under this connector ("fail" to keep vLLM's)
    load_failure: Annotated[Literal["recompute", "fail"], Meta(description="'recompute' or 'fail'")] = "recompute"
    #: the longest a request whose ``kv_transfer_params`` ask for a prefetch waits for it (:mod:`.hint`)
    prefetch_wait_s: Seconds = 2.0
    #: a load that ends before the prompt's last token: layer by layer as the forward reaches each layer (True), or
    #: every layer in one batch before the forward starts (False: one round of node calls instead of one a layer)
    layerwise: bool = True

    @classmethod
    def from_extra(cls, extra: Any, where: str = _WHERE) -> "ConnectorConfig":
        """vLLM's ``kv_connector_extra_config`` (a JSON object) checked; ``etcd`` may be one ``"h:p,h:p"`` string, as
        on the command line."""
        config: ConnectorConfig = super().from_extra(extra, where)
        return config


def kv_role(role: Any, where: str = "kv_role") -> Role:
    """``role`` if it is one of :data:`ROLES`; ``ConfigError`` naming ``where`` otherwise."""
    return validated(_Role, role, where)


def kv_transfer_config(config: ConnectorConfig, role: str = "kv_both") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for an engine using the pool of ``config`` in ``role``; only the settings
    that differ from the defaults are written out."""
    kv_role(role, "role")
    defaults = ConnectorConfig()
    extra = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in msgspec.structs.asdict(config).items()
        if v != getattr(defaults, k)
    }
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": role,
        "kv_load_failure_policy": config.load_failure,
        "kv_connector_extra_config": extra,
    }
