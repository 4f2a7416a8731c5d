"""etcd over TLS with client-certificate authentication, started for real with certificates from kvpool's own CA:
the right client works (keys, watches, a watch cache); a client without a certificate, a TLS client given a plaintext
endpoint and a TLS client against a plaintext etcd are each refused with what to do."""

import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core.net import free_ports
from kvpool.core.types import Placement, Tier
from kvpool.errors import ConfigError, MetadataUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.metadata.tls import speaks_tls
from kvpool.servers import certs
from kvpool.servers.etcd import EmbeddedEtcd


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def tls_etcd(tls_dir: Path) -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(tls=certs.server_files(tls_dir)) as server:
        yield server


def _config(server: EmbeddedEtcd, tls_dir: Path, **tls: str) -> MetadataConfig:
    return MetadataConfig(
        endpoints=(server.endpoint,), cluster=f"tls-{uuid.uuid4().hex[:8]}", retry_deadline_s=2.0, **tls
    )


def _client_tls(tls_dir: Path) -> dict[str, str]:
    files = certs.client_files(tls_dir)
    return {"tls_ca": str(files.ca), "tls_cert": str(files.cert), "tls_key": str(files.key)}


def _placement(i: int) -> Placement:
    return Placement(
        key=i.to_bytes(32, "big"), node="n1", tier=Tier.DRAM, offset=i * 64, stored=64, size=64, checksum=i
    )


def test_the_ca_writes_private_keys_0600_and_is_reused(tls_dir: Path, tls_etcd: EmbeddedEtcd) -> None:
    ca_before = (tls_dir / "ca.pem").read_bytes()
    server_before = (tls_dir / "server.pem").read_bytes()
    again = certs.server_files(tls_dir)
    certs.client_files(tls_dir)
    assert (tls_dir / "ca.pem").read_bytes() == ca_before  # clients trust it: never made again
    assert (tls_dir / "server.pem").read_bytes() == server_before and again.cert == tls_dir / "server.pem"
    for key in ("ca-key.pem", "server-key.pem", "client-key.pem"):
        assert stat.S_IMODE(os.stat(tls_dir / key).st_mode) == 0o600
    certs.server_files(tls_dir, ["127.0.0.9"])  # a host it did not name: a new server certificate, same CA
    assert (tls_dir / "ca.pem").read_bytes() == ca_before
    assert (tls_dir / "server.pem").read_bytes() != server_before


def test_a_client_with_the_right_certificate_reads_writes_and_watches(tls_dir: Path, tls_etcd: EmbeddedEtcd) -> None:
    assert speaks_tls("127.0.0.1", tls_etcd.client_port)
    config = _config(tls_etcd, tls_dir, **_client_tls(tls_dir))
    etcd, ns = EtcdClient(config), Namespace(config.cluster)
    try:
        rev = etcd.put(ns.root + b"k", b"v")
        got = etcd.get(ns.root + b"k")
        assert got is not None and got.value == b"v" and got.mod_revision == rev
        watch = etcd.watch(ns.root, rev + 1)
        etcd.put(ns.root + b"k2", b"v2")
        first = next(iter(watch))
        while not first.events:  # the "created" answer comes first
            first = next(iter(watch))
        assert first.events[0].kv.key == ns.root + b"k2"
        watch.cancel()
        with MetadataCache(etcd, ns) as cache:
            PlacementStore(etcd, ns).publish([_placement(i) for i in range(20)], 0)
            cache.sync()
            assert cache.chunk_count() == 20
    finally:
        etcd.delete_prefix(ns.root)
        etcd.close()


def test_a_client_without_a_certificate_is_refused_with_the_fix(tls_dir: Path, tls_etcd: EmbeddedEtcd) -> None:
    plain = EtcdClient(_config(tls_etcd, tls_dir))
    with pytest.raises(MetadataUnavailable, match=r"serves TLS and this client has no TLS settings.*--etcd-tls DIR"):
        plain.put(b"/x", b"y")
    plain.close()
    ca_only = EtcdClient(_config(tls_etcd, tls_dir, tls_ca=str(tls_dir / "ca.pem")))
    with pytest.raises(MetadataUnavailable, match="asks for a client certificate and none is configured"):
        ca_only.get(b"/x")
    ca_only.close()


def test_a_certificate_from_another_ca_is_refused(tls_dir: Path, tls_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    other = certs.client_files(certs.server_files(tmp_path).ca.parent)  # a CA of its own
    config = _config(
        tls_etcd, tls_dir, tls_ca=str(tls_dir / "ca.pem"), tls_cert=str(other.cert), tls_key=str(other.key)
    )
    client = EtcdClient(config)
    with pytest.raises(MetadataUnavailable, match=r"TLS handshake .* failed"):
        client.put(b"/x", b"y")
    client.close()


def test_a_tls_client_refuses_a_plaintext_endpoint_and_a_plaintext_etcd(
    tls_dir: Path, etcd_server: EmbeddedEtcd
) -> None:
    tls = _client_tls(tls_dir)
    with pytest.raises(ConfigError, match="plaintext but TLS is configured"):
        MetadataConfig(endpoints=(f"http://{etcd_server.endpoint}",), **tls)
    with pytest.raises(ConfigError, match="uses TLS but no CA"):
        MetadataConfig(endpoints=(f"https://{etcd_server.endpoint}",))
    client = EtcdClient(_config(etcd_server, tls_dir, **tls))  # the session's etcd: plaintext
    with pytest.raises(MetadataUnavailable, match=r"does not serve TLS.*kvpool etcd --tls-dir"):
        client.get(b"/x")
    client.close()


def test_kvpool_etcd_serves_tls_from_a_tls_dir(tmp_path: Path) -> None:
    """The command line: ``kvpool etcd --tls-dir`` makes the CA and certificates, serves TLS only, and a client
    given that directory's client files works."""
    port, peer = free_ports("127.0.0.1", 2)
    tls_dir = tmp_path / "tls"
    args = ["etcd", "--data-dir", str(tmp_path / "data"), "--port", str(port), "--peer-port", str(peer)]
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("kvpool")), *args, "--tls-dir", str(tls_dir), "--dev"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once it serves
        assert "TLS" in line and str(tls_dir) in line, line
        config = MetadataConfig(endpoints=(f"https://127.0.0.1:{port}",), **_client_tls(tls_dir))
        client = EtcdClient(config)
        assert client.put(b"/cli", json.dumps({"ok": 1}).encode()) > 0
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
