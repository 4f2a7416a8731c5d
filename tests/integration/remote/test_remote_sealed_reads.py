"""Sealed objects of the remote tier read by a client (RemoteReads) from a real SeaweedFS: opened with the right
keys, a miss with a wrong key, no key or altered bytes — and the placement and object kept for readers that hold
the key."""

import base64
import dataclasses
import os
from pathlib import Path

import msgspec
import pytest

from kvpool.core.types import Placement, Tier
from kvpool.errors import SetupError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.pool.chunks import checksum
from kvpool.pool.client.remote_reads import RemoteReads
from kvpool.pool.tiers.crypto import KEY_BYTES, EncryptionConfig
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig

SEALED = "raw+aes256gcm"


def key_file(path: Path, key_id: str) -> EncryptionConfig:
    path.write_text(f"{key_id} {base64.b64encode(os.urandom(KEY_BYTES)).decode()}\n")
    return EncryptionConfig(key_file=str(path))


def test_sealed_objects_open_only_with_the_right_key(
    s3_bucket: RemoteConfig, etcd: EtcdClient, namespace: Namespace, cache: MetadataCache, tmp_path: Path
) -> None:
    right = msgspec.structs.replace(s3_bucket, encryption=key_file(tmp_path / "right", "k1"))
    keys = [os.urandom(32) for _ in range(3)]
    plains = [os.urandom(50_000) for _ in keys]
    ring = right.encryption.keyring()
    assert ring is not None
    placements = []
    with RemoteStore(right, namespace.cluster) as store:
        for k, plain in zip(keys, plains, strict=True):
            sealed = ring.seal(plain, k, "raw")
            store.put(k, SEALED, sealed)
            placements.append(
                Placement(
                    key=k,
                    node=right.name,
                    tier=Tier.REMOTE,
                    offset=0,
                    stored=len(sealed),
                    size=len(plain),
                    checksum=checksum(sealed),
                    codec=SEALED,
                )
            )
            assert plain[:256] not in store.get(k, SEALED)  # the object store sees ciphertext only
        # altered behind the pool's back, its placement's checksum updated too: only the GCM tag can tell
        altered = bytearray(store.get(keys[2], SEALED))
        altered[-100] ^= 1
        store.put(keys[2], SEALED, altered)
        placements[2] = dataclasses.replace(placements[2], checksum=checksum(altered))
    store_of = PlacementStore(etcd, namespace)

    def read(config: RemoteConfig) -> tuple[list[bool | None], list[bytearray]]:
        dests = [bytearray(len(p)) for p in plains]
        reads = RemoteReads(config, namespace.cluster, cache, store_of, lambda items: None, 5.0)
        try:
            return reads.read(placements, [memoryview(d) for d in dests]), dests
        finally:
            reads.close()

    outcomes, dests = read(right)
    assert outcomes == [True, True, None] and [bytes(d) for d in dests[:2]] == plains[:2]
    wrong = msgspec.structs.replace(s3_bucket, encryption=key_file(tmp_path / "wrong", "k1"))  # same id, another key
    other_id = msgspec.structs.replace(s3_bucket, encryption=key_file(tmp_path / "other", "k2"))
    for config in (wrong, other_id, s3_bucket):  # s3_bucket: no keys at all
        outcomes, dests = read(config)
        assert outcomes == [None, None, None], config.encryption
        assert not any(plains[0][:256] in bytes(d) for d in dests)
    with RemoteStore(s3_bucket, namespace.cluster) as store:
        assert len(list(store.list_objects())) == 3  # nothing deleted for a reader without the key


def test_a_process_without_the_key_file_is_told_where_it_must_be(s3_bucket: RemoteConfig, tmp_path: Path) -> None:
    config = msgspec.structs.replace(s3_bucket, encryption=key_file(tmp_path / "keys", "k1"))
    (tmp_path / "keys").unlink()  # this process, on "another host": no key file there
    with pytest.raises(SetupError, match="copy it to the same path on every node and client"):
        config.encryption.keyring()
