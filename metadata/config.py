"""The metadata layer's one validated config object."""

import math
import os
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from kvpool.errors import ConfigError

ENDPOINTS_ENV = "KVPOOL_ETCD_ENDPOINTS"
ETCD_BIN_ENV = "KVPOOL_ETCD_BIN"
ETCD_TXN_MAX_OPS = 128  # etcd's default --max-txn-ops
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
_ENDPOINT = re.compile(r"^(?:https?://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})/?$", re.ASCII)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"http://host:port"`` → ``(host, port)``; ``ConfigError`` otherwise."""
    if not isinstance(text, str):
        raise ConfigError(f"endpoints: {text!r:.60} is a {type(text).__name__}, not a 'host:port' string")
    m = _ENDPOINT.match(text.strip())
    if not m or not 0 < int(m["port"]) < 65536:
        raise ConfigError(
            f"endpoints: {text!r} is not an etcd endpoint; write host:port, e.g. 127.0.0.1:2379 "
            f"(several separated by commas in {ENDPOINTS_ENV})"
        )
    if text.strip().startswith("https://"):
        raise ConfigError(f"endpoints: {text!r} uses TLS, which kvpool does not configure yet; use http://")
    return m["host"].strip("[]"), int(m["port"])


def validate_name(field: str, value: str) -> str:
    """Names that become etcd path segments: letters, digits, ``_ . -``, at most 63 characters."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(
            f"{field} must be 1-63 characters of letters, digits, '_', '.' or '-' "
            f"(it becomes part of etcd keys), got {value!r}"
        )
    return value


@dataclass(frozen=True)
class MetadataConfig:
    """How to reach etcd and how to behave towards it.

    ``endpoints`` empty means "start an embedded etcd" (the local default); otherwise a tuple of
    ``host:port`` strings.  ``cluster`` namespaces every key, so several pools can share one etcd.
    """

    endpoints: tuple[str, ...] = ()
    cluster: str = "default"
    lease_ttl_s: int = 5  #: node records and their placements vanish this long after the node dies
    request_timeout_s: float = 2.0  #: one gRPC call
    retry_deadline_s: float = 5.0  #: retries of one operation stop after this; then MetadataUnavailable
    page_size: int = 1000  #: keys per range request when snapshotting (the client receives at most 4 MiB)
    txn_max_ops: int = ETCD_TXN_MAX_OPS

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            raise ConfigError("endpoints must be a tuple of 'host:port' strings, not one string")
        if not isinstance(self.endpoints, (tuple, list)):
            raise ConfigError(f"endpoints must be a tuple of 'host:port' strings, got {self.endpoints!r:.60}")
        for ep in self.endpoints:
            parse_endpoint(ep)
        validate_name("cluster", self.cluster)
        if not isinstance(self.lease_ttl_s, int) or isinstance(self.lease_ttl_s, bool) or self.lease_ttl_s < 1:
            raise ConfigError(
                f"lease_ttl_s must be an int >= 1 (etcd leases have 1 s resolution), got {self.lease_ttl_s!r}"
            )
        for name in ("request_timeout_s", "retry_deadline_s"):
            value = getattr(self, name)
            if not _number(value) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a number > 0 seconds, got {value!r}")
        if not _int(self.page_size) or self.page_size < 1:
            raise ConfigError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if not _int(self.txn_max_ops) or not 1 <= self.txn_max_ops <= 10_000:
            raise ConfigError(
                f"txn_max_ops must be an int in [1, 10000] (etcd's default is 128), got {self.txn_max_ops!r}"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> "MetadataConfig":
        """Defaults, then ``KVPOOL_ETCD_ENDPOINTS`` (comma-separated), then explicit overrides."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ConfigError(f"unknown metadata settings {', '.join(unknown)}; known: {', '.join(known)}")
        cfg = cls()
        env = os.environ.get(ENDPOINTS_ENV, "").strip()
        if env:
            cfg = replace(cfg, endpoints=tuple(e.strip() for e in env.split(",") if e.strip()))
        return replace(cfg, **overrides) if overrides else cfg

    def with_endpoints(self, *endpoints: str) -> "MetadataConfig":
        return replace(self, endpoints=tuple(endpoints))


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
