"""Child processes for the metadata tests: run as ``python procs.py <role> <json args>``.

They print one JSON line when ready, so that the parent waits on an event, not on a sleep.
"""

import json
import os
import sys
import time

from kvpool.core.types import NodeRecord, Placement, Tier
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.metadata.registry import NodeRegistry


def placements(node: str, n: int, tag: int = 0) -> list[Placement]:
    return [
        Placement(
            key=i.to_bytes(32, "big"), node=node, tier=Tier.DRAM, offset=i * 4096, stored=4096, size=4096, checksum=tag
        )
        for i in range(n)
    ]


def node(args: dict) -> None:
    """Register a node with placements on its lease, then live until killed."""
    cfg = MetadataConfig(endpoints=(args["endpoint"],), cluster=args["cluster"], lease_ttl_s=args["ttl"])
    etcd, ns = EtcdClient(cfg), Namespace(cfg.cluster)
    reg = NodeRegistry(etcd, ns, cfg.lease_ttl_s).register(NodeRecord(args["node"], "127.0.0.1", os.getpid()))
    PlacementStore(etcd, ns).publish(placements(args["node"], args["chunks"]), reg.lease_id)
    print(json.dumps({"ready": True, "lease": reg.lease_id}), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    {"node": node}[sys.argv[1]](json.loads(sys.argv[2]))
