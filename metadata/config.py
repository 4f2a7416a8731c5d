"""The metadata layer's one validated config object."""

import os
import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvpool.core.config import Config, Positive, Rule, Seconds, validated
from kvpool.errors import ConfigError, SetupError

ENDPOINTS_ENV = "KVPOOL_ETCD_ENDPOINTS"
ETCD_BIN_ENV = "KVPOOL_ETCD_BIN"
#: the environment variables of :meth:`MetadataConfig.from_env` for TLS, by field
TLS_ENV = {"tls_ca": "KVPOOL_ETCD_CA", "tls_cert": "KVPOOL_ETCD_CERT", "tls_key": "KVPOOL_ETCD_KEY"}
ETCD_TXN_MAX_OPS = 128  # etcd's default --max-txn-ops
_NAME_RULE = "1-63 characters of letters, digits, '_', '.' or '-' (it becomes part of etcd keys)"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}\Z")
#: a name that becomes an etcd path segment
Name = Annotated[str, Meta(pattern=_NAME.pattern, description=_NAME_RULE)]
_TLS_MISMATCH = {
    "https": f"endpoints: {{ep!r}} uses TLS but no CA is configured: set tls_ca ({TLS_ENV['tls_ca']}, or --etcd-tls DIR), "
    "with tls_cert and tls_key if etcd asks for client certificates",
    "http": f"endpoints: {{ep!r}} is plaintext but TLS is configured (tls_ca / {TLS_ENV['tls_ca']}): write host:port or "
    "https://host:port; kvpool does not send its metadata unencrypted once told to use TLS",
}
_PemFile = Annotated[str, Meta(description="a path string to a PEM file ('' for none)")]
_PORT = r"[1-9]\d{0,3}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d{2}|655[0-2]\d|6553[0-5]"  # 1-65535
_ENDPOINT = re.compile(
    rf"^\s*(?:https?://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(?P<port>{_PORT})/?\s*\Z", re.ASCII
)
#: an etcd endpoint: ``host:port``, ``http://host:port`` or ``https://host:port``
Endpoint = Annotated[
    str,
    Meta(
        pattern=_ENDPOINT.pattern,
        description=f"an etcd endpoint: host:port, e.g. 127.0.0.1:2379 (several separated by commas in {ENDPOINTS_ENV})",
    ),
]


def parse_endpoint(text: str) -> tuple[str, int]:
    """An :data:`Endpoint` → ``(host, port)``; ``ConfigError`` otherwise.  Whether the scheme fits the TLS
    settings is :class:`MetadataConfig`'s to check."""
    m = _ENDPOINT.match(validated(Endpoint, text, "endpoints"))
    assert m is not None  # the pattern was checked
    return m["host"].strip("[]"), int(m["port"])


def validate_name(field: str, value: str) -> str:
    """Names that become etcd path segments: letters, digits, ``_ . -``, at most 63 characters.  Keys are built per
    metadata call, so a good name is passed by the regex alone; only a bad one goes through :data:`Name`'s msgspec
    check, which words the ``ConfigError``."""
    if isinstance(value, str) and _NAME.match(value):
        return value
    return validated(Name, value, field)


class MetadataConfig(Config, frozen=True):
    """How to reach etcd and how to behave towards it.

    ``endpoints`` empty means "start an embedded etcd" (the local default); otherwise a tuple of
    ``host:port`` strings: the members of one etcd cluster, which the client fails over between.  ``cluster``
    namespaces every key, so several pools can share one etcd.

    ``tls_ca`` set means etcd is reached over TLS only (an ``http://`` endpoint is refused), trusting that CA;
    ``tls_cert`` and ``tls_key`` are the client certificate etcd's client-certificate authentication asks for.
    The paths are made absolute here, and this config travels to Ray actors: every node needs the files at the
    same paths.
    """

    endpoints: Annotated[tuple[Endpoint, ...], Meta(description="a tuple of 'host:port' strings")] = ()
    cluster: Name = "default"
    #: node records and their placements vanish this long after the node dies
    lease_ttl_s: Annotated[int, Meta(ge=1, description="an int >= 1 (etcd leases have 1 s resolution)")] = 5
    request_timeout_s: Seconds = 2.0  #: one gRPC call
    retry_deadline_s: Seconds = 5.0  #: retries of one operation stop after this; then MetadataUnavailable
    #: keys per range request when snapshotting (~2 MB of placements; a page over the client's receive limit is halved)
    page_size: Positive = 10_000
    txn_max_ops: Annotated[int, Meta(ge=1, le=10_000, description="an int in [1, 10000]; etcd's default is 128")] = (
        ETCD_TXN_MAX_OPS
    )
    tls_ca: _PemFile = ""  #: PEM file of the CA that signed etcd's certificate; set: TLS only
    tls_cert: _PemFile = ""  #: PEM file of the client certificate presented to etcd (with ``tls_key``)
    tls_key: _PemFile = ""  #: PEM file of its private key
    tls_server_name: str = ""  #: check etcd's certificate for this name instead of the endpoint's host

    rules = (
        Rule(
            "together",
            "tls_cert",
            "tls_key",
            f"a client certificate is presented with its private key ({TLS_ENV['tls_cert']}, {TLS_ENV['tls_key']})",
        ),
        Rule("needs", "tls_cert", "tls_ca", f"give the CA that signed etcd's certificate ({TLS_ENV['tls_ca']})"),
        Rule("needs", "tls_server_name", "tls_ca", "the name is checked in etcd's certificate, which TLS shows"),
    )

    def check(self) -> None:
        self._check_tls()
        for ep in self.endpoints:
            scheme = ep.strip().partition("://")[0] if "://" in ep else ""
            if scheme and (scheme == "https") != self.tls:
                raise ConfigError(_TLS_MISMATCH[scheme].format(ep=ep))

    @property
    def tls(self) -> bool:
        """Whether etcd is reached over TLS."""
        return bool(self.tls_ca)

    def _check_tls(self) -> None:
        """Each TLS path: a string, made absolute, naming a readable file."""
        for name, env in TLS_ENV.items():
            value = getattr(self, name)
            if not value:
                continue
            path = os.path.abspath(os.path.expanduser(value))
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise SetupError(
                    f"{name} ({env}): {path} is not a readable file; copy it from the directory the etcd "
                    "certificates were made in (kvpool certs, kvpool etcd --tls-dir) or fix the path"
                )
            msgspec.structs.force_setattr(self, name, path)

    @classmethod
    def from_env(cls, **overrides: Any) -> "MetadataConfig":
        """Defaults, then ``KVPOOL_ETCD_ENDPOINTS`` (comma-separated) and the TLS files ``KVPOOL_ETCD_CA``,
        ``KVPOOL_ETCD_CERT``, ``KVPOOL_ETCD_KEY``, then explicit overrides."""
        settings: dict[str, Any] = {
            name: os.environ[var].strip() for name, var in TLS_ENV.items() if os.environ.get(var, "").strip()
        }
        env = os.environ.get(ENDPOINTS_ENV, "").strip()
        if env:
            settings["endpoints"] = tuple(e.strip() for e in env.split(",") if e.strip())
        # msgspec names the first field that fails: unknown names first (the likelier slip), then the overrides
        known = {f.name for f in msgspec.structs.fields(cls)}
        given = {k: overrides[k] for k in sorted(overrides, key=lambda k: (k in known, k))}
        given.update((k, v) for k, v in settings.items() if k not in overrides)
        return validated(cls, given, "metadata settings")

    def with_endpoints(self, *endpoints: str) -> "MetadataConfig":
        return msgspec.structs.replace(self, endpoints=tuple(endpoints))
