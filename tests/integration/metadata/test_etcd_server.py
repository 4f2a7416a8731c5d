import os
import subprocess
import sys

import pytest

from kvpool.errors import ConfigError, SetupError
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import ENDPOINTS_ENV, ETCD_BIN_ENV, MetadataConfig
from kvpool.servers.etcd import EmbeddedEtcd, etcd_binary

_CHILD = """
from kvpool.servers.etcd import EmbeddedEtcd
server = EmbeddedEtcd().start()
print(server.pid, server.base_dir, flush=True)
"""  # exits without calling stop(): the interpreter's exit must take etcd down


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_embedded_etcd_stops_at_interpreter_exit() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    pid, base_dir = out.stdout.split()
    assert not _alive(int(pid))
    assert not os.path.exists(base_dir)  # its temporary directory is gone too


def test_stop_removes_the_temporary_directory() -> None:
    server = EmbeddedEtcd().start()
    client = EtcdClient(MetadataConfig(endpoints=(server.endpoint,)))
    assert client.put(b"/k", b"v") > 1
    client.close()
    pid = server.pid
    server.stop()
    assert pid is not None and not _alive(pid) and not server.base_dir.exists()


def test_endpoints_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENDPOINTS_ENV, "127.0.0.5:2379, http://127.0.0.6:2380")
    assert MetadataConfig.from_env().endpoints == ("127.0.0.5:2379", "http://127.0.0.6:2380")
    assert MetadataConfig.from_env(cluster="c2").cluster == "c2"
    monkeypatch.setenv(ENDPOINTS_ENV, "127.0.0.5")
    with pytest.raises(ConfigError, match="host:port"):
        MetadataConfig.from_env()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"endpoints": "127.0.0.1:2379"}, "endpoints"),
        ({"endpoints": ("127.0.0.1:99999",)}, "endpoints"),
        ({"cluster": "a/b"}, "cluster"),
        ({"cluster": ""}, "cluster"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"page_size": 0}, "page_size"),
        ({"txn_max_ops": 0}, "txn_max_ops"),
    ],
)
def test_malformed_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        MetadataConfig(**kwargs)  # type: ignore[arg-type]


def test_a_wrong_etcd_binary_is_a_setup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ETCD_BIN_ENV, "/nonexistent/etcd")
    with pytest.raises(SetupError, match=ETCD_BIN_ENV):
        etcd_binary()
