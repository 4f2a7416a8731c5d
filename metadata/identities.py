"""The cache identities clients use, in etcd, and the trap they reveal: two clients of one model whose identities
differ never share a chunk.

A chunk key chain starts from the SHA-256 of the cache identity (model, KV dtype, layout, chunk size, TP size and
rank, codec), so two engines that serve the same model but disagree on one of those — another dtype, block size or
attention backend — hash every prompt differently and see zero hits across each other, with nothing failing.  Each
connector registers the identities it uses (``PoolClient.register_identity``) under
``/kvpool/<cluster>/identities/<fingerprint>`` on a lease of :data:`IDENTITY_TTL_S`; ``kvpool status`` lists them
and :func:`disagreements` names what differs between identities of one model.
"""

import os
import socket
import time
from collections.abc import Iterable

from msgspec.structs import asdict

from kvpool.core.keys import CacheIdentity
from kvpool.core.types import IdentityRecord
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import FINGERPRINT_HEX, Namespace
from kvpool.metadata.records import encode_identity

IDENTITY_TTL_S = 24 * 3600  #: an identity nobody registered again for this long leaves the list


def fingerprint(identity: CacheIdentity) -> str:
    """What names an identity in etcd and in ``kvpool status``: the first hex digits of its key chain's root."""
    return identity.root().hex()[:FINGERPRINT_HEX]


def register(etcd: EtcdClient, namespace: Namespace, identity: CacheIdentity) -> str:
    """Record that this process uses ``identity`` (for :data:`IDENTITY_TTL_S`); its fingerprint."""
    record = IdentityRecord(identity, socket.gethostname(), os.getpid(), time.time())
    name = fingerprint(identity)
    etcd.put(namespace.identity(name), encode_identity(record), lease=etcd.grant_lease(IDENTITY_TTL_S))
    return name


def disagreements(records: Iterable[IdentityRecord]) -> list[str]:
    """For each model with identities that differ other than by TP rank (each rank of one engine has its own),
    a sentence naming the fields and values that differ: their chunks never match."""
    by_model: dict[str, dict[str, dict[str, object]]] = {}
    for r in records:
        fields = {k: v for k, v in asdict(r.identity).items() if k not in ("model", "tp_rank")}
        by_model.setdefault(r.identity.model, {})[repr(sorted(fields.items()))] = fields
    out = []
    for model, variants in sorted(by_model.items()):
        if len(variants) < 2:
            continue
        kinds = list(variants.values())
        differ = [k for k in kinds[0] if len({repr(v[k]) for v in kinds}) > 1]
        said = "; ".join(f"{k}: {', '.join(sorted({str(v[k]) for v in kinds}))}" for k in differ)
        out.append(
            f"model {model} is cached under {len(kinds)} identities that differ in {said}: their chunks never "
            "match (zero hits across those clients); give every engine of the model the same settings"
        )
    return out
