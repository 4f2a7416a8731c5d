"""etcd's TLS settings before any etcd runs: the config refuses what cannot work (with what to do), reads the
environment, stays picklable with absolute paths; the CA makes, reuses and reissues files as it says;
``kvpool etcd --peers`` is parsed strictly."""

import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
from cryptography import x509

from kvpool.cli import options
from kvpool.cli.servers import _peers
from kvpool.errors import ConfigError, SetupError
from kvpool.metadata.config import TLS_ENV, MetadataConfig
from kvpool.servers import certs


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    certs.server_files(d, ["10.1.2.3", "etcd.example"])
    certs.client_files(d)
    return d


def _tls(d: Path) -> dict[str, str]:
    return {"tls_ca": str(d / "ca.pem"), "tls_cert": str(d / "client.pem"), "tls_key": str(d / "client-key.pem")}


def test_files_keys_and_names(made: Path) -> None:
    assert {p.name for p in made.iterdir()} >= {"ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem"}
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    for key in ("ca-key.pem", "server-key.pem", "client-key.pem"):
        assert stat.S_IMODE(os.stat(made / key).st_mode) == 0o600
    server = x509.load_pem_x509_certificate((made / "server.pem").read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = {str(n) for n in san.get_values_for_type(x509.IPAddress)} | set(san.get_values_for_type(x509.DNSName))
    assert names == {"127.0.0.1", "10.1.2.3", "localhost", "etcd.example", certs.SERVER_NAME}
    client = x509.load_pem_x509_certificate((made / "client.pem").read_bytes())
    assert client.subject.rfc4514_string() == "CN=client"
    client.verify_directly_issued_by(x509.load_pem_x509_certificate((made / "ca.pem").read_bytes()))


def test_a_copy_without_the_ca_key_serves_and_never_makes_a_ca(made: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)
    (copy / "ca-key.pem").unlink()
    before = (copy / "server.pem").read_bytes()
    certs.server_files(copy, ["10.9.9.9"])  # not named, no key to reissue: kept, clients check kvpool-etcd
    assert (copy / "server.pem").read_bytes() == before and not (copy / "ca-key.pem").exists()
    with pytest.raises(SetupError, match="no CA key to issue one"):
        certs.client_files(copy, "other")
    with pytest.raises(SetupError, match=r"no ca\.pem in"):
        certs.client_files(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()


def test_the_config_takes_tls_files_as_absolute_paths_and_pickles(made: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(made)
    config = MetadataConfig(endpoints=("https://127.0.0.1:2379", "127.0.0.2:2379"), tls_ca="ca.pem")
    assert config.tls and config.tls_ca == str(made / "ca.pem")
    full = MetadataConfig(endpoints=("127.0.0.1:2379",), **_tls(made))
    assert pickle.loads(pickle.dumps(full)) == full and os.path.isabs(full.tls_key)


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"tls_ca": "/nonexistent/ca.pem"}, "KVPOOL_ETCD_CA.*not a readable file"),
        ({"tls_cert": "client.pem"}, "tls_cert and tls_key go together: a client certificate is presented with its"),
        (
            {"tls_cert": "client.pem", "tls_key": "client-key.pem"},
            "tls_cert is set but tls_ca is not: give the CA that signed etcd's certificate",
        ),
        ({"tls_ca": 3}, "path string"),
        ({"tls_server_name": "kvpool-etcd"}, "tls_server_name is set but tls_ca is not"),
        ({"tls_ca": "ca.pem", "endpoints": ("http://127.0.0.1:2379",)}, "plaintext but TLS is configured"),
        ({"endpoints": ("https://127.0.0.1:2379",)}, "uses TLS but no CA"),
    ],
)
def test_tls_settings_that_cannot_work_are_refused(
    made: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, object], match: str
) -> None:
    monkeypatch.chdir(made)
    with pytest.raises((ConfigError, SetupError), match=match):
        MetadataConfig(**settings)  # type: ignore[arg-type]


def test_from_env_and_the_command_line(made: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for field, path in _tls(made).items():
        monkeypatch.setenv(TLS_ENV[field], path)
    monkeypatch.setenv("KVPOOL_ETCD_ENDPOINTS", "https://127.0.0.1:2379")
    env = MetadataConfig.from_env()
    assert env.tls_cert == str(made / "client.pem") and env.endpoints == ("https://127.0.0.1:2379",)
    from_dir = options.metadata_config("127.0.0.1:2379", "c1", str(made))
    assert from_dir.tls_server_name == certs.SERVER_NAME and from_dir.tls_key == str(made / "client-key.pem")
    for var in TLS_ENV.values():
        monkeypatch.delenv(var)
    monkeypatch.setenv(options.TLS_DIR_ENV, str(made))
    assert options.metadata_config("127.0.0.1:2379", "c1").tls_ca == str(made / "ca.pem")


def test_peers_syntax() -> None:
    assert _peers("a=10.0.0.1:2380, b=10.0.0.2:2380,c=10.0.0.3:2380", tls=False) == {
        "a": "10.0.0.1:2380",
        "b": "10.0.0.2:2380",
        "c": "10.0.0.3:2380",
    }
    assert _peers("a=https://h1:2380,b=h2:2380", tls=True) == {"a": "h1:2380", "b": "h2:2380"}
    for bad, match in [
        ("a=h:2380", "at least two"),
        ("a=h:2380,bh:2380", "not name=host:port"),
        ("a=h:2380,b=h", "host:port"),
        ("a=http://h:2380,b=h:2381", "peers talk TLS"),
        ("a/x=h:2380,b=h:2381", "letters, digits"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _peers(bad, tls=bad.count("http://") > 0)
