"""The S3 (remote) tier's settings, checked when they are made: importing this needs neither boto3 nor torch (nor
more of ``cryptography`` than its AES-GCM, for the tier's encryption at rest)."""

from typing import Annotated

from msgspec import Meta, field

from kvpool.core.config import Config, Rule, Seconds
from kvpool.metadata.config import Name
from kvpool.pool.tiers.crypto import EncryptionConfig

#: S3's bucket naming rules; empty: the remote tier is off
_Bucket = Annotated[
    str,
    Meta(
        pattern=r"^((?!\d+\.\d+\.\d+\.\d+\Z)(?!.*(\.\.|\.-|-\.))[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])?\Z",
        description="an S3 bucket name (3-63 characters of lowercase letters, digits, '.' and '-', starting and "
        "ending with a letter or digit, no '..', '.-' or '-.', not an IP address), or empty for no remote tier",
    ),
]
_Url = Annotated[
    str,
    Meta(
        pattern=r"^(https?://(\[[0-9a-fA-F:]+\]|[^/:?#\s\[\]]+)(:\d{1,5})?([/?#]\S*)?)?\Z",
        description="an http:// or https:// URL such as http://127.0.0.1:8333, or empty for AWS_ENDPOINT_URL / AWS",
    ),
]
_SEGMENT = r"(?!\.\.?(?:/|\Z))[A-Za-z0-9_.-]+"
_Prefix = Annotated[
    str,
    Meta(
        pattern=rf"^{_SEGMENT}(?:/{_SEGMENT})*\Z",
        description="'/'-separated segments of letters, digits, '_', '.' or '-' (no leading, trailing or double '/')",
    ),
]
_Region = Annotated[str, Meta(pattern=r"^\S*\Z", description="a region name such as us-east-1, or empty")]

GC_GRACE_S = 3600.0  #: ``kvpool gc`` leaves objects younger than this alone (flushes in flight)


def check_codec(spec: object) -> None:
    """``ConfigError`` naming the spec and the grammar unless ``spec`` is a codec spec; the codecs (and torch) are
    imported only for a spec other than ``raw``."""
    if spec != "raw":
        from kvpool.pool.tiers.codecs import parse_codec

        parse_codec(spec)  # type: ignore[arg-type]


class RemoteConfig(Config, frozen=True):
    """Where the remote tier keeps chunks, and when chunks go there.

    Empty ``endpoint_url``, ``region``, ``access_key_id`` and ``secret_access_key`` fall back to boto3's own
    resolution (the ``AWS_*`` environment, ``~/.aws``); see the module docstring.
    """

    bucket: _Bucket = ""  #: the S3 bucket; empty: the remote tier is off
    endpoint_url: _Url = ""  #: e.g. ``http://127.0.0.1:8333``; empty: ``AWS_ENDPOINT_URL(_S3)``, else AWS
    prefix: _Prefix = "kvpool"  #: objects are ``<prefix>/<cluster>/<chunk key hex>``
    region: _Region = ""  #: empty: ``AWS_REGION``, ``AWS_DEFAULT_REGION`` or ``~/.aws/config``, else us-east-1
    access_key_id: str = ""  #: with ``secret_access_key``; both empty: boto3's credential chain
    secret_access_key: str = ""  #: never shown in a repr or a log line
    codec: str = "raw"  #: the codec chunks are stored with in this tier (a spec ``parse_codec`` accepts)
    flush_after_s: Seconds = 86400.0  #: NVMe chunks idle longer than this are flushed to the remote tier
    promote_on_hit: bool = True  #: a hit on a remote chunk copies it back into the node's DRAM
    timeout_s: Seconds = 5.0  #: connect and read timeout of one request (each is retried once)
    name: Name = "s3"  #: the holder name placements in this tier record (a node_id, so the same rules)
    #: encryption at rest: every object sealed with AES-256-GCM after ``codec`` (pool/tiers/crypto.py); off until a
    #: key file or variable is set; every node and client that uses the tier needs the keys
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.__rich_repr__() if k != "secret_access_key")
        return f"RemoteConfig({shown})"

    rules = (
        Rule(
            "together",
            "access_key_id",
            "secret_access_key",
            "give both, or neither for boto3's credential chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "~/.aws/credentials)",
        ),
    )

    def check(self) -> None:
        check_codec(self.codec)

    @property
    def enabled(self) -> bool:
        """Whether the remote tier is on (a bucket is set)."""
        return bool(self.bucket)
