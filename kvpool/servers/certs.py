"""A small certificate authority for one pool's etcd: TLS for the control plane, client certificates for access.

The files live in one directory per cluster (:func:`default_dir`: ``~/.config/kvpool/<cluster>/tls``), as PEM:

==================================  ==========================================================================
``ca.pem`` / ``ca-key.pem``         the CA every member and client trusts; its key only signs the others
``server.pem`` / ``server-key.pem`` etcd's certificate, for clients and for its peers (server and client use)
``client.pem`` / ``client-key.pem`` what kvpool's clients present (CN ``client``); others by :func:`client_files`
==================================  ==========================================================================

Keys are EC P-256, written 0600 in a 0700 directory.  Whatever is already there is reused: the CA is never
regenerated while its files exist (clients trust it), and a certificate is issued again only when it is missing,
was not signed by this CA, expires within :data:`RENEW_BEFORE`, or (the server's) does not name a host asked for.
Every server certificate also names :data:`SERVER_NAME`, so a client can verify etcd without knowing the address
it will be reached at (a cluster's head IP is often unknown when the certificates are made).
"""

import datetime
import fcntl
import ipaddress
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from msgspec import Meta

from kvpool.core.config import checked
from kvpool.errors import ConfigError, SetupError

log = logging.getLogger(__name__)

#: the DNS name in every server certificate made here; clients given a kvpool-made directory verify etcd by it
SERVER_NAME = "kvpool-etcd"
CA_DAYS, LEAF_DAYS = 3650, 825
RENEW_BEFORE = datetime.timedelta(days=30)
_ALWAYS = ("127.0.0.1", "localhost", SERVER_NAME)


def default_dir(cluster: str = "default") -> Path:
    """``$XDG_CONFIG_HOME/kvpool/<cluster>/tls`` (``~/.config`` without it)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base, "kvpool", cluster, "tls").absolute()


@dataclass(frozen=True)
class ServerTls:
    """What an etcd member serves with: the CA it trusts (clients and peers) and its own pair."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClientTls:
    """What a client presents: the CA it trusts and its own pair."""

    ca: Path
    cert: Path
    key: Path


def server_files(directory: str | os.PathLike[str], hosts: Iterable[str] = ()) -> ServerTls:
    """The CA and a server certificate valid for ``hosts`` (and 127.0.0.1, localhost, :data:`SERVER_NAME`) in
    ``directory``, made there if needed."""
    d = _directory(directory)
    wanted = {h for h in (*_ALWAYS, *hosts) if h and h != "0.0.0.0"}
    with _locked(d):
        ca_cert, ca_key = _authority(d)
        cert_path, key_path = d / "server.pem", d / "server-key.pem"
        current = _valid_leaf(cert_path, key_path, ca_cert)
        have = _names(current) if current is not None else set()
        if current is not None and ca_key is None and not wanted <= have and SERVER_NAME in have:
            log.warning(
                "%s does not name %s and there is no CA key to issue one that does: kvpool's clients verify it as "
                "%s, other clients must too",
                cert_path,
                ", ".join(sorted(wanted - have)),
                SERVER_NAME,
            )
        elif current is None or not wanted <= have:
            why = f"is missing, expiring or does not name {', '.join(sorted(wanted - have))}"
            _issue(cert_path, key_path, ca_cert, ca_key, "kvpool etcd", wanted | have, server=True, why=why)
    return ServerTls(d / "ca.pem", cert_path, key_path)


#: a client certificate's name (its CN and file name): not one of the names the CA and etcd's own files take
_ClientName = Annotated[
    str,
    Meta(
        pattern=r"^(?!(ca|ca-key|server)\Z)[A-Za-z0-9_-]+\Z",
        description="letters, digits, '-' and '_' only, and not ca or server",
    ),
]


@checked
def client_files(directory: str | os.PathLike[str], name: _ClientName = "client") -> ClientTls:
    """The CA and the client certificate ``name`` (its CN) in ``directory``: ``<name>.pem`` and ``<name>-key.pem``,
    made there if missing and the CA key is present.  Never makes a CA: a client trusts the one etcd's was made by."""
    d = Path(directory).expanduser().absolute()
    if not (d / "ca.pem").is_file():
        raise SetupError(
            f"no ca.pem in {d}: make the certificates there (kvpool certs --tls-dir DIR, or kvpool etcd --tls-dir "
            "DIR) or copy ca.pem, client.pem and client-key.pem from the machine that made them"
        )
    cert_path, key_path = d / f"{name}.pem", d / f"{name}-key.pem"
    with _locked(d):
        ca_cert, ca_key = _authority(d)
        if _valid_leaf(cert_path, key_path, ca_cert) is None:
            _issue(cert_path, key_path, ca_cert, ca_key, name, set(), server=False, why="is missing or not valid")
    return ClientTls(d / "ca.pem", cert_path, key_path)


# -- the CA -----------------------------------------------------------------------------------------------------


def _directory(directory: str | os.PathLike[str]) -> Path:
    d = Path(directory).expanduser().absolute()
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise SetupError(f"cannot create the TLS directory {d}: {exc}") from exc
    return d


@contextmanager
def _locked(d: Path) -> Iterator[None]:
    """One writer at a time per directory (three members started at once share one CA)."""
    try:
        f = open(d / ".lock", "a")  # noqa: SIM115 (closed below)
    except OSError:  # a read-only copy on a client: nothing will be written there
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _authority(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey | None]:
    """The CA of ``d``, made if absent; its key is None where only ``ca.pem`` was copied (a client's machine)."""
    cert_path, key_path = d / "ca.pem", d / "ca-key.pem"
    if cert_path.exists():
        cert = _load_cert(cert_path)
        return cert, _load_key(key_path) if key_path.exists() else None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvpool CA {os.urandom(4).hex()}")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), secret=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), secret=False)
    return cert, key


def _issue(
    cert_path: Path,
    key_path: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey | None,
    cn: str,
    hosts: set[str],
    *,
    server: bool,
    why: str,
) -> None:
    """A leaf certificate signed by the CA, made because the one at ``cert_path`` ``why``; only where the CA key is.
    A server's is for client and server use: etcd's gateway and its peers connect with it as a client."""
    if ca_key is None:
        raise SetupError(
            f"{cert_path} {why}, and there is no CA key to issue one ({cert_path.parent / 'ca-key.pem'}): run this "
            f"where the CA key is, or copy {cert_path.name} and {key_path.name} from the directory where the CA was "
            "made (kvpool certs --tls-dir DIR)"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(sorted(map(_san, hosts), key=str)), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write(key_path, _key_pem(key), secret=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), secret=False)


def _valid_leaf(cert_path: Path, key_path: Path, ca_cert: x509.Certificate) -> x509.Certificate | None:
    """The certificate at ``cert_path`` if it is signed by ``ca_cert``, lasts beyond :data:`RENEW_BEFORE` and has
    its key; else None (to be issued again)."""
    if not cert_path.exists() or not key_path.exists():
        return None
    cert = _load_cert(cert_path)
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return None
    if cert.not_valid_after_utc - RENEW_BEFORE < _now():
        return None
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    return cert if key.public_key() == cert.public_key() else None


def _names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in san.get_values_for_type(x509.IPAddress)} | set(san.get_values_for_type(x509.DNSName))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    """Atomically, so a reader never sees half a file; keys 0600 from the moment they exist."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600 if secret else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise SetupError(f"{path} is not a readable PEM certificate ({exc}); remove it to have it made again") from exc


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SetupError(f"{path} is not a readable, unencrypted PEM key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{path} is a {type(key).__name__}; kvpool's CA makes and expects EC P-256 keys")
    return key
