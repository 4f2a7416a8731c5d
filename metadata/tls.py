"""etcd over TLS: a client's gRPC credentials from its config, and what went wrong when TLS is on one side only or
a certificate is refused (told from the server's answer to a handshake, with the fix)."""

import socket
import ssl

import grpc

from kvpool.errors import SetupError
from kvpool.metadata.config import TLS_ENV, MetadataConfig

#: how to reach etcd over TLS from the command line, for error messages
HOW = f"--etcd-tls DIR (the cluster's certificate directory), or {', '.join(TLS_ENV.values())}"


def credentials(config: MetadataConfig) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, int | str]]]:
    """The channel credentials and options of ``config``'s TLS settings (None and none without TLS)."""
    if not config.tls:
        return None, []
    creds = grpc.ssl_channel_credentials(
        _read(config.tls_ca),
        _read(config.tls_key) if config.tls_key else None,
        _read(config.tls_cert) if config.tls_cert else None,
    )
    opts: list[tuple[str, int | str]] = []
    if config.tls_server_name:
        opts.append(("grpc.ssl_target_name_override", config.tls_server_name))
    return creds, opts


def speaks_tls(host: str, port: int, timeout_s: float = 1.0) -> bool | None:
    """Whether the server at ``host:port`` answers a TLS handshake (certificates unchecked: this only tells a TLS
    listener from a plaintext one); None when it cannot be reached."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, ctx.wrap_socket(raw) as tls:
            tls.do_handshake()
        return True
    except ssl.SSLError as exc:  # an alert (e.g. certificate required) is a TLS server talking
        return "ALERT" in str(exc).upper()
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        return False  # hung up on a ClientHello: a plaintext server
    except OSError:
        return None


def mismatch(config: MetadataConfig, host: str, port: int, details: str) -> str | None:
    """What is wrong, and the fix, when a call to the member at ``host:port`` failed with gRPC's ``details`` because
    of TLS on one side only or a refused certificate; None for any other failure.  Asks the member whether it speaks
    TLS, so it costs a connection."""
    low = details.lower()
    where = f"etcd at {host}:{port}"
    if config.tls:
        if "handshake" not in low and "ssl" not in low and "tls" not in low:
            return None
        tls = speaks_tls(host, port)
        if tls is None:
            return None  # not reachable now (a member restarting): retriable
        if not tls:
            return (
                f"{where} does not serve TLS, and this client is configured for TLS only ({HOW}): start "
                "etcd with TLS (kvpool etcd --tls-dir DIR) or point the client at the TLS etcd"
            )
        if not config.tls_cert and "certificate" in low:
            return (
                f"{where} asks for a client certificate and none is configured: give one signed by etcd's CA "
                f"({HOW}) [{details}]"
            )
        return (
            f"the TLS handshake with {where} failed: etcd's certificate must be signed by {config.tls_ca} "
            f"and name the host (or tls_server_name), and the client's by the CA etcd trusts [{details}]"
        )
    if "socket closed" in low and speaks_tls(host, port):
        return (
            f"{where} serves TLS and this client has no TLS settings: give it the cluster's CA and a client "
            f"certificate ({HOW})"
        )
    return None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SetupError(f"cannot read {path} for etcd's TLS ({exc}); every node needs the file at that path") from exc
