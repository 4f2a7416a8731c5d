"""Tenants: whose KV a chunk is, decided by the pool from a secret, never by what a request says.

A shared pool holds every tenant's prompts in a reusable form, and a prefix lookup is a probe: whoever can compute
another tenant's keys can tell (by a hit, or by its timing) what that tenant asked.  So a tenant's keys are made
from a root only its secret gives: the chain of :mod:`kvpool.core.keys` starts at

    H_0 = HMAC-SHA256(secret, "kvpool.tenant/1" || SHA-256(cache identity))

instead of the identity's own hash.  Two tenants' keys never meet, and a tenant cannot compute another's without
its secret: a lookup of another tenant's prompt finds nothing, whatever tokens it sends.  The secret stays with the
processes that compute keys (the serving front and its workers, from the tenants file); pool nodes and etcd see
only keys and, for quotas and metrics, the tenant's name.

Sharing across tenants is opt-in on both sides: a *shared namespace* (e.g. ``public`` for a common system prompt)
has a secret of its own, and a request may use it only if its tenant lists it.  Its chunks are charged to the
tenant that put them.

The tenants file (TOML), what ``kvpool up --tenants`` and ``WorkerConfig.tenants`` read::

    [tenants.acme]
    secret = "3f1c…"            # hex, >= 16 bytes (kvpool tenants new-secret prints one); or secret_env = "VAR"
    api_keys = ["sk-acme-1"]    # the HTTP front's bearer tokens that act as this tenant
    dram_mib = 512              # quota per node (0: none): over it, the tenant's own LRU chunks go first
    nvme_mib = 4096
    shared = ["public"]

    [shared.public]
    secret = "9ab0…"
"""

import hashlib
import hmac
import os
import re
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvpool.core.config import Config, validated
from kvpool.errors import ConfigError, SetupError, TenantRefused
from kvpool.pool.config import MiB

ROOT_TAG = b"kvpool.tenant/1"
MIN_SECRET_BYTES = 16
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}\Z")
_Names = tuple[Annotated[str, Meta(min_length=1)], ...]
_MiB = Annotated[int, Meta(ge=0, description="an int >= 0 (MiB per node; 0: no quota)")]


class _Shared(Config, frozen=True):
    """A ``[shared.<name>]`` table of a tenants file."""

    secret: str = ""
    secret_env: str = ""


class _Tenant(_Shared, frozen=True):
    """A ``[tenants.<name>]`` table of a tenants file."""

    api_keys: Annotated[_Names, Meta(description="a list of non-empty strings")] = ()
    dram_mib: _MiB = 0
    nvme_mib: _MiB = 0
    shared: Annotated[_Names, Meta(description="a list of [shared.<name>] names")] = ()


_Tables = Annotated[str, Meta(pattern=_NAME.pattern)]
_TABLE_RULE = "tables such as [{}.acme]; names are 1-63 letters, digits, '_', '.' or '-'"
#: a tenant's name, as puts carry it ("" for none)
TenantName = Annotated[
    str,
    Meta(
        pattern=rf"^({_NAME.pattern[1:-2]})?\Z",
        description="a tenant's name (1-63 letters, digits, '_', '.', '-') or '' for none",
    ),
]


class _File(Config, frozen=True):
    """A tenants file: ``[tenants.*]`` and ``[shared.*]`` tables."""

    tenants: Annotated[dict[_Tables, _Tenant], Meta(description=_TABLE_RULE.format("tenants"))] = msgspec.field(
        default_factory=dict
    )
    shared: Annotated[dict[_Tables, _Shared], Meta(description=_TABLE_RULE.format("shared"))] = msgspec.field(
        default_factory=dict
    )

    def check(self) -> None:
        if not self.tenants:
            raise ConfigError("no [tenants.<name>] table; add at least one tenant")


def new_secret() -> str:
    """A fresh 32-byte secret, hex: what a tenants file's ``secret`` takes."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class Scope:
    """Whose keys a request's chunks get: a tenant's own, or a shared namespace's; ``tenant`` is charged for them."""

    name: str  #: ``tenant:<name>`` or ``shared:<namespace>``
    tenant: str  #: who puts and reads under this scope (quotas, metrics)
    secret: bytes = field(repr=False)

    def root(self, identity_root: bytes) -> bytes:
        """``H_0`` of this scope's chain for a cache whose identity hashes to ``identity_root``."""
        return hmac.new(self.secret, ROOT_TAG + identity_root, hashlib.sha256).digest()


@dataclass(frozen=True)
class Tenant:
    name: str
    secret: bytes = field(repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    dram_bytes: int = 0  #: quota per node (0: none)
    nvme_bytes: int = 0
    shared: tuple[str, ...] = ()  #: shared namespaces its requests may use


@dataclass(frozen=True)
class Tenants:
    """The tenants a front serves and the shared namespaces they may meet in; validated when built."""

    tenants: Mapping[str, Tenant]
    shared: Mapping[str, bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for t in self.tenants.values():
            if unknown := [s for s in t.shared if s not in self.shared]:
                raise ConfigError(f"tenant {t.name!r} lists shared namespace {unknown[0]!r}, which has no [shared.*]")
        owners: dict[str, str] = {}
        for t in self.tenants.values():
            for key in t.api_keys:
                if key in owners:
                    raise ConfigError(f"tenants {owners[key]!r} and {t.name!r} share an API key; give each its own")
                owners[key] = t.name

    @classmethod
    def load(cls, path: str) -> "Tenants":
        """Read a tenants file (TOML, above); ``ConfigError`` naming what is wrong and where."""
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except OSError as exc:
            raise SetupError(f"tenants file {path!r} cannot be read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"tenants file {path!r} is not TOML: {exc}") from None
        return cls.parse(doc, where=path)

    @classmethod
    def parse(cls, doc: Mapping[str, Any], where: str = "tenants") -> "Tenants":
        """A tenants file's tables (TOML, above) as :class:`Tenants`; ``ConfigError`` naming ``where``."""
        file = validated(_File, doc, where)
        tenants = {
            name: Tenant(
                name,
                _secret(t, f"{where}: [tenants.{name}]"),
                t.api_keys,
                t.dram_mib * MiB,
                t.nvme_mib * MiB,
                t.shared,
            )
            for name, t in file.tenants.items()
        }
        return cls(tenants, {name: _secret(s, f"{where}: [shared.{name}]") for name, s in file.shared.items()})

    def scope(self, tenant: str, namespace: str = "") -> Scope:
        """The scope a request of ``tenant`` gets (its own, or the shared ``namespace`` if it may use it)."""
        t = self.tenants.get(tenant) if isinstance(tenant, str) else None
        if t is None:
            raise TenantRefused(f"unknown tenant {tenant!r:.40}: add it to the tenants file")
        if not namespace:
            return Scope(f"tenant:{t.name}", t.name, t.secret)
        if namespace not in t.shared:
            raise TenantRefused(
                f"tenant {t.name!r} may not use shared namespace {namespace!r:.40}; list it in [tenants.{t.name}] shared"
            )
        return Scope(f"shared:{namespace}", t.name, self.shared[namespace])

    def by_api_key(self, api_key: str) -> str:
        """The tenant whose API key this is; ``TenantRefused`` if none."""
        found = self._holder(api_key)
        if not found:
            raise TenantRefused(
                "no tenant holds this API key: send 'Authorization: Bearer <key>' with a key of the tenants file"
            )
        return found

    def knows(self, api_key: str) -> bool:
        return bool(self._holder(api_key))

    def _holder(self, api_key: str) -> str:
        """The tenant holding ``api_key`` ("" if none); every key is compared, in constant time."""
        found = ""
        for t in self.tenants.values():
            for key in t.api_keys:
                if isinstance(api_key, str) and hmac.compare_digest(key.encode(), api_key.encode()):
                    found = t.name
        return found

    def quotas(self) -> dict[str, tuple[int, int]]:
        """``tenant → (DRAM bytes, NVMe bytes)`` per node, for the tenants that have a quota (what nodes enforce)."""
        return {n: (t.dram_bytes, t.nvme_bytes) for n, t in self.tenants.items() if t.dram_bytes or t.nvme_bytes}


def _secret(table: "_Shared", at: str) -> bytes:
    text = table.secret
    if table.secret_env:
        text = os.environ.get(table.secret_env, "")
        if not text:
            raise SetupError(f"{at}: secret_env names {table.secret_env!r:.40}, which is not set in the environment")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{at}: the secret must be at least {MIN_SECRET_BYTES} bytes of hex (kvpool tenants new-secret prints one)"
        )
    return secret
