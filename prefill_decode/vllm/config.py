"""What a vLLM engine needs to use the pool: ``kv_connector_extra_config`` validated (:class:`ConnectorConfig`) and
the whole ``--kv-transfer-config`` (:func:`kv_transfer_config`).  No vLLM import here: ``kvpool vllm-config`` runs
where vLLM is not installed, e.g. on the pool's head node."""

import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvpool.core.config import Config, Positive, default_of, validated
from kvpool.core.keys import DEFAULT_CHUNK_SIZE
from kvpool.metadata.config import MetadataConfig, Name
from kvpool.pool.config import PoolConfig

#: vLLM's kv_role: an engine that saves and loads, one that saves (prefill) or one that loads (decode)
Role = Literal["kv_both", "kv_producer", "kv_consumer"]
ROLES: tuple[str, ...] = typing.get_args(Role)
_Role = Annotated[Role, Meta(description=f"one of {', '.join(ROLES)}")]
CONNECTOR = "KvPoolConnector"
MODULE = "kvpool.prefill_decode.vllm_connector"
_WHERE = "kv_connector_extra_config"
_ETCD = "a list of 'host:port' strings, or one 'host:port,host:port' string"


class ConnectorConfig(Config, frozen=True):
    """``kv_connector_extra_config``, validated (:meth:`from_extra`); unknown keys are refused.  The defaults of
    the pool's own settings are those of :class:`PoolConfig` and :class:`MetadataConfig`."""

    #: etcd endpoints (``host:port``); empty: ``KVPOOL_ETCD_ENDPOINTS``
    etcd: Annotated[tuple[Annotated[str, Meta(min_length=1)], ...], Meta(description=_ETCD)] = ()
    cluster: Name = default_of(MetadataConfig, "cluster")  #: the pool's cluster name (its etcd prefix)
    namespace: str = default_of(PoolConfig, "namespace")  #: the Ray namespace of the pool's PoolNode actors
    ray_address: str = "auto"  #: the Ray cluster the pool runs on (worker side)
    #: the file holding that cluster's token (never the token itself); "": where Ray looks (kvpool/ray_auth.py)
    ray_token_path: str = ""
    node_ip: str = ""  #: this host's Ray node IP, when a machine runs several Ray nodes (tests: 127.0.0.x)
    model_id: str = ""  #: the model's name in the cache identity; empty: vLLM's served model name
    chunk_size: Positive = DEFAULT_CHUNK_SIZE  #: tokens per chunk: a multiple of vLLM's block size
    replicas: Positive = 1  #: distinct nodes each saved chunk is written to
    #: vLLM's kv_load_failure_policy under this connector ("fail" to keep vLLM's)
    load_failure: Annotated[Literal["recompute", "fail"], Meta(description="'recompute' or 'fail'")] = "recompute"
    #: a tenants file (pool/tenants.py): a request's ``cache_salt`` must then be a tenant's API key, and its chunks are
    #: keyed in that tenant's chain; a request without one is served without the pool.  "": no tenants
    tenants: str = ""

    @classmethod
    def from_extra(cls, extra: Any) -> "ConnectorConfig":
        """vLLM's ``kv_connector_extra_config`` (a JSON object) checked; ``etcd`` may be one ``"h:p,h:p"`` string,
        as on the command line."""
        if isinstance(extra, dict) and isinstance(extra.get("etcd"), str):
            extra = {**extra, "etcd": [e.strip() for e in extra["etcd"].split(",") if e.strip()]}
        return validated(cls, extra, _WHERE)

    def metadata(self) -> MetadataConfig:
        base = MetadataConfig.from_env(cluster=self.cluster)
        return base.with_endpoints(*self.etcd) if self.etcd else base


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
