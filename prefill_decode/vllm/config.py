"""What a vLLM engine needs to use the pool: ``kv_connector_extra_config`` validated (:class:`ConnectorConfig`) and
the whole ``--kv-transfer-config`` (:func:`kv_transfer_config`).  No vLLM import here: ``kvpool vllm-config`` runs
where vLLM is not installed, e.g. on the pool's head node."""

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvpool.core.keys import DEFAULT_CHUNK_SIZE
from kvpool.errors import ConfigError
from kvpool.metadata.config import MetadataConfig

ROLES = ("kv_both", "kv_producer", "kv_consumer")
CONNECTOR = "KvPoolConnector"
MODULE = "kvpool.prefill_decode.vllm_connector"


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, validated; unknown keys are refused."""

    etcd: tuple[str, ...] = ()  #: etcd endpoints (``host:port``); empty: ``KVPOOL_ETCD_ENDPOINTS``
    cluster: str = "default"  #: the pool's cluster name (its etcd prefix)
    namespace: str = "kvpool"  #: the Ray namespace of the pool's PoolNode actors
    ray_address: str = "auto"  #: the Ray cluster the pool runs on (worker side)
    #: the file holding that cluster's token (never the token itself); "": where Ray looks (kvpool/ray_auth.py)
    ray_token_path: str = ""
    node_ip: str = ""  #: this host's Ray node IP, when a machine runs several Ray nodes (tests: 127.0.0.x)
    model_id: str = ""  #: the model's name in the cache identity; empty: vLLM's served model name
    chunk_size: int = DEFAULT_CHUNK_SIZE  #: tokens per chunk: a multiple of vLLM's block size
    replicas: int = 1  #: distinct nodes each saved chunk is written to
    load_failure: str = "recompute"  #: vLLM's kv_load_failure_policy under this connector ("fail" to keep vLLM's)
    #: a tenants file (pool/tenants.py): a request's ``cache_salt`` must then be a tenant's API key, and its chunks are
    #: keyed in that tenant's chain; a request without one is served without the pool.  "": no tenants
    tenants: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.etcd, tuple) or not all(isinstance(e, str) and e for e in self.etcd):
            raise ConfigError(f"kv_connector_extra_config.etcd must be a list of 'host:port', got {self.etcd!r:.80}")
        for name in ("cluster", "namespace", "ray_address", "ray_token_path", "node_ip", "model_id", "tenants"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"kv_connector_extra_config.{name} must be a string, got {getattr(self, name)!r:.60}")
        for name in ("chunk_size", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"kv_connector_extra_config.{name} must be an int >= 1, got {value!r:.60}")
        if self.load_failure not in ("recompute", "fail"):
            raise ConfigError(
                f"kv_connector_extra_config.load_failure must be 'recompute' or 'fail', got {self.load_failure!r:.40}"
            )

    @classmethod
    def from_extra(cls, extra: Any) -> "ConnectorConfig":
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown keys {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}"
            )
        values = dict(extra)
        if isinstance(values.get("etcd"), str):  # "h:p,h:p" as on the command line
            values["etcd"] = tuple(e.strip() for e in values["etcd"].split(",") if e.strip())
        elif isinstance(values.get("etcd"), list):
            values["etcd"] = tuple(values["etcd"])
        return cls(**values)

    def metadata(self) -> MetadataConfig:
        base = MetadataConfig.from_env(cluster=self.cluster)
        return base.with_endpoints(*self.etcd) if self.etcd else base


def kv_transfer_config(config: ConnectorConfig, role: str = "kv_both") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for an engine using the pool of ``config`` in ``role``; only the settings
    that differ from the defaults are written out."""
    if role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    defaults = ConnectorConfig()
    extra = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items() if v != getattr(defaults, k)}
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": role,
        "kv_load_failure_policy": config.load_failure,
        "kv_connector_extra_config": extra,
    }
