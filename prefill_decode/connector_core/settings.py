"""Where an engine finds the pool: the settings every engine's connector takes from its engine's config."""

from typing import Annotated, Any

from msgspec import Meta

from kvpool.core.config import Config, Positive, default_of, validated
from kvpool.metadata.config import MetadataConfig, Name
from kvpool.pool.config import PoolConfig

_ETCD = "a list of 'host:port' strings, or one 'host:port,host:port' string"


class PoolSettings(Config, frozen=True):
    """The pool an engine process attaches to (etcd, its cluster, the Ray cluster of its nodes), what the engine's
    chunks are keyed and stored as (model name, replicas) and whose they are (tenants).  An engine's config derives
    from it and adds its own; the defaults of the pool's settings are those of :class:`PoolConfig` and
    :class:`MetadataConfig`."""

    #: etcd endpoints (``host:port``); empty: ``KVPOOL_ETCD_ENDPOINTS``
    etcd: Annotated[tuple[Annotated[str, Meta(min_length=1)], ...], Meta(description=_ETCD)] = ()
    cluster: Name = default_of(MetadataConfig, "cluster")  #: the pool's cluster name (its etcd prefix)
    namespace: str = default_of(PoolConfig, "namespace")  #: the Ray namespace of the pool's PoolNode actors
    ray_address: str = "auto"  #: the Ray cluster the pool runs on
    #: the file holding that cluster's token (never the token itself); "": where Ray looks (kvpool/ray_auth.py)
    ray_token_path: str = ""
    node_ip: str = ""  #: this host's Ray node IP, when a machine runs several Ray nodes (tests: 127.0.0.x)
    model_id: str = ""  #: the model's name in the cache identity; empty: the engine's own name for it
    replicas: Positive = 1  #: distinct nodes each saved chunk is written to
    #: a tenants file (pool/tenants.py): chunks are then keyed in a tenant's chain; "": no tenants
    tenants: str = ""

    @classmethod
    def from_extra(cls, extra: Any, where: str) -> Any:
        """An engine's extra config (a JSON object) checked as ``cls``; ``etcd`` may be one ``"h:p,h:p"`` string, as
        on a command line.  ``where`` names the config in errors."""
        if isinstance(extra, dict) and isinstance(extra.get("etcd"), str):
            extra = {**extra, "etcd": [e.strip() for e in extra["etcd"].split(",") if e.strip()]}
        return validated(cls, extra, where)

    def metadata(self) -> MetadataConfig:
        base = MetadataConfig.from_env(cluster=self.cluster)
        return base.with_endpoints(*self.etcd) if self.etcd else base

    def pool(self) -> PoolConfig:
        """The pool's config as a client in the engine's process needs it."""
        return PoolConfig(metadata=self.metadata(), namespace=self.namespace)
