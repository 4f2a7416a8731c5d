"""Cache identities in a real etcd: registered, seen by every watch cache, listed by ``kvpool status --wide`` and
``--json``, and two identities of one model that differ named as a warning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec

from kvpool.core.keys import CacheIdentity
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.identities import fingerprint, register
from kvpool.metadata.namespace import Namespace

KVPOOL = str(Path(sys.executable).with_name("kvpool"))
LLAMA = CacheIdentity(model="llama", kv_dtype="bfloat16", layout="groups-of-4", chunk_size=256)


def test_registered_identities_are_listed_and_a_disagreement_is_named(
    etcd: EtcdClient, namespace: Namespace, cache: MetadataCache, metadata_config: MetadataConfig
) -> None:
    fp = register(etcd, namespace, LLAMA)
    assert fp == fingerprint(LLAMA)
    cache.sync()
    assert cache.identities()[fp].identity == LLAMA and cache.identities()[fp].pid == os.getpid()
    other = msgspec.structs.replace(LLAMA, kv_dtype="float16")
    register(etcd, namespace, other)
    args = ["status", "--etcd", metadata_config.endpoints[0], "--cluster", metadata_config.cluster]
    env = {**os.environ, "COLUMNS": "200"}
    wide = subprocess.run([KVPOOL, *args, "--wide"], capture_output=True, text=True, timeout=120, env=env)
    assert wide.returncode == 0, wide.stderr
    assert fp in wide.stdout and fingerprint(other) in wide.stdout
    assert "warning: model llama is cached under 2 identities that differ in kv_dtype: bfloat16, float16" in wide.stdout
    as_json = subprocess.run([KVPOOL, *args, "--json"], capture_output=True, text=True, timeout=120, env=env)
    snap = json.loads(as_json.stdout)
    assert {i["fingerprint"] for i in snap["identities"]} == {fp, fingerprint(other)} and len(snap["warnings"]) == 1
