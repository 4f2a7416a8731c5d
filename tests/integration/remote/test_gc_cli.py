"""``kvpool gc`` against a real etcd and a real S3 server: orphan objects deleted, dangling placements dropped."""

import os
import subprocess
import sys
from pathlib import Path

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Placement, Tier
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig


def test_gc_deletes_orphans_and_drops_dangling_placements(
    s3_bucket: RemoteConfig, metadata_config: MetadataConfig, etcd: EtcdClient
) -> None:
    cluster = metadata_config.cluster
    kept, dangling, orphan = chunk_keys(CacheIdentity(model="gc", kv_dtype="u8", layout="b", chunk_size=1), range(3))

    def placement(key: bytes) -> Placement:
        return Placement(key, s3_bucket.name, Tier.REMOTE, offset=0, stored=5, size=5, checksum=0)

    PlacementStore(etcd, Namespace(cluster)).publish([placement(kept), placement(dangling)], 0)
    with RemoteStore(s3_bucket, cluster) as store:
        store.put(kept, "raw", b"kept!")
        store.put(orphan, "raw", b"orphan")
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": s3_bucket.access_key_id,
            "AWS_SECRET_ACCESS_KEY": s3_bucket.secret_access_key,
        }
        args = ["--s3-bucket", s3_bucket.bucket, "--s3-endpoint", s3_bucket.endpoint_url]
        where = ["--etcd", metadata_config.endpoints[0], "--cluster", cluster]
        kvpool = [str(Path(sys.executable).with_name("kvpool")), "gc", *args, *where]
        young = subprocess.run(kvpool, env=env, capture_output=True, text=True, timeout=120)
        assert young.returncode == 0, young.stderr
        # the orphan is younger than --grace; rich may wrap the line: compare words
        assert "0 orphan objects deleted, 1 placements" in " ".join(young.stdout.split())
        old = subprocess.run([*kvpool, "--grace", "0"], env=env, capture_output=True, text=True, timeout=120)
        assert old.returncode == 0, old.stderr
        assert "1 orphan objects deleted, 0 placements" in " ".join(old.stdout.split())
        assert [o.name for o in store.list_objects()] == [store.object_name(kept, "raw")]
    held = PlacementStore(etcd, Namespace(cluster)).held_by(s3_bucket.name)
    assert [p.key for p in held] == [kept]  # the dangling placement is dropped
