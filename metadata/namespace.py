"""Where things live in etcd.

``/kvpool/<cluster>/nodes/<node>``            → NodeRecord, bound to the node's lease
``/kvpool/<cluster>/chunks/<key hex>/<node>`` → Placement of one replica, bound to the holder's lease
``/kvpool/<cluster>/sync``                     → a barrier marker (see ``MetadataCache.sync``)
"""

from dataclasses import dataclass

from kvpool.metadata.config import validate_name

KEY_BYTES = 32  # chunk keys are SHA-256 digests (kvpool.pool.keys)


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
    def sync_marker(self) -> bytes:
        """Written by ``MetadataCache.sync`` as a barrier; holds nothing else."""
        return self.root + b"sync"

    def node(self, node_id: str) -> bytes:
        return self.nodes + validate_name("node_id", node_id).encode()

    def chunk(self, key: bytes) -> bytes:
        """The prefix holding every replica of one chunk."""
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {key!r}")
        return self.chunks + key.hex().encode() + b"/"

    def replica(self, key: bytes, node_id: str) -> bytes:
        return self.chunk(key) + validate_name("node_id", node_id).encode()

    def parse_replica(self, etcd_key: bytes) -> tuple[bytes, str]:
        """``(chunk key, node id)`` from a replica's etcd key; ``ValueError`` if it is not one."""
        if not etcd_key.startswith(self.chunks):
            raise ValueError(f"{etcd_key!r} is not under {self.chunks!r}")
        hexkey, sep, node = etcd_key[len(self.chunks) :].decode().partition("/")
        if not sep or len(hexkey) != 2 * KEY_BYTES or not node:
            raise ValueError(f"{etcd_key!r} is not <chunks>/<key hex>/<node>")
        return bytes.fromhex(hexkey), node

    def parse_node(self, etcd_key: bytes) -> str:
        if not etcd_key.startswith(self.nodes):
            raise ValueError(f"{etcd_key!r} is not under {self.nodes!r}")
        return etcd_key[len(self.nodes) :].decode()
