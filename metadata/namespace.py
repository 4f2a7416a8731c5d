"""Where things live in etcd.

``/kvpool/<cluster>/nodes/<node>``            → NodeRecord, bound to the node's lease
``/kvpool/<cluster>/chunks/<key hex>/<node>`` → Placement of one replica, bound to the holder's lease
``/kvpool/<cluster>/sync``                     → a barrier marker (see ``MetadataCache.sync``)
``/kvpool/<cluster>/identities/<fingerprint>`` → a cache identity a client uses (see ``kvpool.metadata.identities``)
``/kvpool/<cluster>/gone/<key hex>/<node>``     → Tombstone: why the node dropped the chunk, on a tombstone lease
``/kvpool/<cluster>/departed/<node>``          → Departure: the node's record left etcd, on a tombstone lease
"""

import re
from dataclasses import dataclass

from kvpool.core.keys import KEY_BYTES, check_key
from kvpool.errors import ConfigError, MalformedRecord
from kvpool.metadata.config import validate_name

_KEY_HEX = re.compile(rb"[0-9a-f]{%d}" % (2 * KEY_BYTES))  # lower case, as chunk() writes it
FINGERPRINT_HEX = 16  #: hex digits of a cache identity's root that name it
_FINGERPRINT = re.compile(rb"[0-9a-f]{%d}" % FINGERPRINT_HEX)


@dataclass(frozen=True)
class Namespace:
    cluster: str

    def __post_init__(self) -> None:
        validate_name("cluster", self.cluster)

    @property
    def root(self) -> bytes:
        return f"/kvpool/{self.cluster}/".encode()

    @property
    def nodes(self) -> bytes:
        return self.root + b"nodes/"

    @property
    def chunks(self) -> bytes:
        return self.root + b"chunks/"

    @property
    def identities(self) -> bytes:
        return self.root + b"identities/"

    def identity(self, fingerprint: str) -> bytes:
        return self.identities + fingerprint.encode()

    def parse_identity(self, etcd_key: bytes) -> str:
        """The fingerprint of an identity record's etcd key; ``MalformedRecord`` otherwise."""
        raw = etcd_key[len(self.identities) :] if isinstance(etcd_key, bytes) else b""
        if (
            not isinstance(etcd_key, bytes)
            or not etcd_key.startswith(self.identities)
            or not _FINGERPRINT.fullmatch(raw)
        ):
            raise MalformedRecord(f"etcd key {etcd_key!r:.120} is not <identities>/<{FINGERPRINT_HEX} hex digits>")
        return raw.decode()

    @property
    def sync_marker(self) -> bytes:
        """Written by ``MetadataCache.sync`` as a barrier; holds nothing else."""
        return self.root + b"sync"

    def node(self, node_id: str) -> bytes:
        return self.nodes + validate_name("node_id", node_id).encode()

    def chunk(self, key: bytes) -> bytes:
        """The prefix holding every replica of one chunk."""
        check_key(key, "chunk key")
        return self.chunks + key.hex().encode() + b"/"

    def replica(self, key: bytes, node_id: str) -> bytes:
        return self.chunk(key) + validate_name("node_id", node_id).encode()

    @property
    def gone(self) -> bytes:
        return self.root + b"gone/"

    def tombstone(self, key: bytes, node_id: str) -> bytes:
        return self.gone + self.chunk(key)[len(self.chunks) :] + validate_name("node_id", node_id).encode()

    def parse_tombstone(self, etcd_key: bytes) -> tuple[bytes, str]:
        """``(chunk key, node id)`` of a tombstone's etcd key; ``MalformedRecord`` otherwise."""
        if not isinstance(etcd_key, bytes) or not etcd_key.startswith(self.gone):
            raise MalformedRecord(f"etcd key {etcd_key!r:.120} is not under {self.gone!r}")
        return self.parse_replica(self.chunks + etcd_key[len(self.gone) :])

    @property
    def departed(self) -> bytes:
        return self.root + b"departed/"

    def departure(self, node_id: str) -> bytes:
        return self.departed + validate_name("node_id", node_id).encode()

    def parse_departure(self, etcd_key: bytes) -> str:
        if not isinstance(etcd_key, bytes) or not etcd_key.startswith(self.departed):
            raise MalformedRecord(f"etcd key {etcd_key!r:.120} is not under {self.departed!r}")
        return self._node_name(etcd_key, etcd_key[len(self.departed) :])

    def parse_replica(self, etcd_key: bytes) -> tuple[bytes, str]:
        """``(chunk key, node id)`` from a replica's etcd key, exactly as :meth:`replica` writes it;
        ``MalformedRecord`` otherwise."""
        if not isinstance(etcd_key, bytes) or not etcd_key.startswith(self.chunks):
            raise MalformedRecord(f"etcd key {etcd_key!r:.120} is not under {self.chunks!r}")
        hexkey, sep, node = etcd_key[len(self.chunks) :].partition(b"/")
        if not sep or not _KEY_HEX.fullmatch(hexkey):
            raise MalformedRecord(f"etcd key {etcd_key!r:.120} is not <chunks>/<{2 * KEY_BYTES} hex digits>/<node>")
        return bytes.fromhex(hexkey.decode()), self._node_name(etcd_key, node)

    def parse_node(self, etcd_key: bytes) -> str:
        """The node id of a node record's etcd key, exactly as :meth:`node` writes it; ``MalformedRecord``
        otherwise."""
        if not isinstance(etcd_key, bytes) or not etcd_key.startswith(self.nodes):
            raise MalformedRecord(f"etcd key {etcd_key!r:.120} is not under {self.nodes!r}")
        return self._node_name(etcd_key, etcd_key[len(self.nodes) :])

    @staticmethod
    def _node_name(etcd_key: bytes, raw: bytes) -> str:
        try:
            return validate_name("node_id", raw.decode())
        except (UnicodeDecodeError, ConfigError) as exc:
            raise MalformedRecord(f"etcd key {etcd_key!r:.120} does not end in a node id: {exc}") from None
