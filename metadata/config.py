"""The metadata layer's one validated config object."""

import math
import os
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from kvpool.errors import ConfigError

ENDPOINTS_ENV = "KVPOOL_ETCD_ENDPOINTS"
ETCD_BIN_ENV = "KVPOOL_ETCD_BIN"
#: the environment variables of :meth:`MetadataConfig.from_env` for TLS, by field
TLS_ENV = {"tls_ca": "KVPOOL_ETCD_CA", "tls_cert": "KVPOOL_ETCD_CERT", "tls_key": "KVPOOL_ETCD_KEY"}
ETCD_TXN_MAX_OPS = 128  # etcd's default --max-txn-ops
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
_ENDPOINT = re.compile(r"^(?:https?://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})/?$", re.ASCII)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"host:port"``, ``"http://host:port"`` or ``"https://host:port"`` → ``(host, port)``; ``ConfigError``
    otherwise.  Whether the scheme fits the TLS settings is :class:`MetadataConfig`'s to check."""
    if not isinstance(text, str):
        raise ConfigError(f"endpoints: {text!r:.60} is a {type(text).__name__}, not a 'host:port' string")
    m = _ENDPOINT.match(text.strip())
    if not m or not 0 < int(m["port"]) < 65536:
        raise ConfigError(
            f"endpoints: {text!r} is not an etcd endpoint; write host:port, e.g. 127.0.0.1:2379 "
            f"(several separated by commas in {ENDPOINTS_ENV})"
        )
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
    ``host:port`` strings: the members of one etcd cluster, which the client fails over between.  ``cluster``
    namespaces every key, so several pools can share one etcd.

    ``tls_ca`` set means etcd is reached over TLS only (an ``http://`` endpoint is refused), trusting that CA;
    ``tls_cert`` and ``tls_key`` are the client certificate etcd's client-certificate authentication asks for.
    The paths are made absolute here, and this config travels to Ray actors: every node needs the files at the
    same paths.
    """

    endpoints: tuple[str, ...] = ()
    cluster: str = "default"
    lease_ttl_s: int = 5  #: node records and their placements vanish this long after the node dies
    request_timeout_s: float = 2.0  #: one gRPC call
    retry_deadline_s: float = 5.0  #: retries of one operation stop after this; then MetadataUnavailable
    #: keys per range request when snapshotting (~2 MB of placements; a page over the client's receive limit is halved)
    page_size: int = 10_000
    txn_max_ops: int = ETCD_TXN_MAX_OPS
    tls_ca: str = ""  #: PEM file of the CA that signed etcd's certificate; set: TLS only
    tls_cert: str = ""  #: PEM file of the client certificate presented to etcd (with ``tls_key``)
    tls_key: str = ""  #: PEM file of its private key
    tls_server_name: str = ""  #: check etcd's certificate for this name instead of the endpoint's host

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            raise ConfigError("endpoints must be a tuple of 'host:port' strings, not one string")
        if not isinstance(self.endpoints, (tuple, list)):
            raise ConfigError(f"endpoints must be a tuple of 'host:port' strings, got {self.endpoints!r:.60}")
        self._check_tls()
        for ep in self.endpoints:
            parse_endpoint(ep)
            scheme = ep.strip().partition("://")[0] if "://" in ep else ""
            if scheme == "http" and self.tls:
                raise ConfigError(
                    f"endpoints: {ep!r} is plaintext but TLS is configured (tls_ca / {TLS_ENV['tls_ca']}): write "
                    "host:port or https://host:port; kvpool does not send its metadata unencrypted once told to use TLS"
                )
            if scheme == "https" and not self.tls:
                raise ConfigError(
                    f"endpoints: {ep!r} uses TLS but no CA is configured: set tls_ca ({TLS_ENV['tls_ca']}, or "
                    "--etcd-tls DIR), with tls_cert and tls_key if etcd asks for client certificates"
                )
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

    @property
    def tls(self) -> bool:
        """Whether etcd is reached over TLS."""
        return bool(self.tls_ca)

    def _check_tls(self) -> None:
        """Each TLS path: a string, made absolute, naming a readable file; a certificate comes with its key and
        needs the CA that verifies etcd."""
        for name, env in TLS_ENV.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a path string ('' for none), got {value!r:.60}")
            if not value:
                continue
            path = os.path.abspath(os.path.expanduser(value))
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise ConfigError(
                    f"{name} ({env}): {path} is not a readable file; copy it from the directory the etcd "
                    "certificates were made in (kvpool certs, kvpool etcd --tls-dir) or fix the path"
                )
            object.__setattr__(self, name, path)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                f"tls_cert and tls_key ({TLS_ENV['tls_cert']}, {TLS_ENV['tls_key']}) go together: a client "
                "certificate is presented with its private key"
            )
        if self.tls_cert and not self.tls_ca:
            raise ConfigError(
                f"tls_cert is set but tls_ca ({TLS_ENV['tls_ca']}) is not: give the CA that signed etcd's certificate"
            )
        if not isinstance(self.tls_server_name, str) or (self.tls_server_name and not self.tls_ca):
            raise ConfigError(f"tls_server_name must be a host name and needs tls_ca, got {self.tls_server_name!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> "MetadataConfig":
        """Defaults, then ``KVPOOL_ETCD_ENDPOINTS`` (comma-separated) and the TLS files ``KVPOOL_ETCD_CA``,
        ``KVPOOL_ETCD_CERT``, ``KVPOOL_ETCD_KEY``, then explicit overrides."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ConfigError(f"unknown metadata settings {', '.join(unknown)}; known: {', '.join(known)}")
        settings: dict[str, Any] = {
            name: os.environ[var].strip() for name, var in TLS_ENV.items() if os.environ.get(var, "").strip()
        }
        env = os.environ.get(ENDPOINTS_ENV, "").strip()
        if env:
            settings["endpoints"] = tuple(e.strip() for e in env.split(",") if e.strip())
        return cls(**{**settings, **overrides})

    def with_endpoints(self, *endpoints: str) -> "MetadataConfig":
        return replace(self, endpoints=tuple(endpoints))


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
