"""Encryption at rest: a tier's stored bytes sealed with AES-256-GCM, under keys of a keyring.

What is sealed.  With encryption configured for a tier (``PoolConfig.encryption`` for NVMe, ``RemoteConfig.encryption``
for S3), every chunk stored there is sealed after its codec: a tensor under the tier's codec (``fp8-e4m3+zstd`` ->
``fp8-e4m3+zstd+aes256gcm``) and a chunk put as plain bytes alike (``raw+aes256gcm``).  That is why encryption is a
setting of the tier and not a stage of the codec spec: a spec applies only to chunks put as tensors (a codec needs a
dtype and shape), while most chunks arrive as plain bytes and must be sealed too.  The stored codec name ends in
``+aes256gcm`` (:data:`STAGE`), so placements, ``kvpool chunks`` and every reader see that the bytes are sealed, and an
S3 object sealed is another object than the same chunk unsealed (:func:`~kvpool.pool.tiers.codecs.codec_key`).
The pool's checksum is over the stored, sealed bytes, like any codec's output: a flipped bit is still caught by the
crc32c before decryption (and then the replica is dropped as corrupt).  DRAM is never sealed: readers copy it
one-sided, straight into their buffers.

Format (integers little-endian)::

    b"KVE\\x01" | u8 n | key id (n ASCII bytes) | 12-byte nonce | ciphertext | 16-byte GCM tag

The associated data is the header before the nonce, then the chunk key (u8 length, bytes), then the codec name below
the seal: a ciphertext copied under another chunk key, or presented as another codec, fails authentication.

Keys.  A :class:`Keyring` maps key ids to 32-byte keys and names the id that seals new chunks (per tenant, later:
the tenant's id).  A chunk is not sealed under a key directly but under a key derived from it for that chunk:
HKDF-SHA256 (RFC 5869; salt ``kvpool aes256gcm v1``, info ``chunk`` + the chunk key).  Keys come from a key file
(``kvpool keys new PATH`` writes and appends to one) or from an environment variable holding the same text; each
process loads its own copy (:meth:`EncryptionConfig.keyring`), so the config holds no key material and travels to
Ray actors as it is.  Every process that reads a sealed tier needs the keys: the ``PoolNode`` (moves, flushes) and
each ``PoolClient`` (reads of a chunk left on NVMe, and of the remote tier).

Nonces.  96 random bits per sealing, under the per-chunk derived key.  A derived nonce (key, chunk key, counter)
would need a counter that never repeats across nodes and restarts, which the pool does not have: two nodes seal the
same chunk key, a chunk is re-sealed on every demotion and flush, and KV computed twice for one key need not be
bit-identical, so a repeated (key, nonce) pair would seal two different plaintexts, which breaks GCM outright.
Random nonces under one key collide with probability ``n**2 / 2**97`` after ``n`` sealings (NIST caps a key at
``2**32``); the per-chunk key makes ``n`` the sealings of one chunk key, a handful, so the volume a master key may
seal is not limited by nonces.

Failures.  Bytes that cannot be opened -- their key id is not in the keyring, the key under that id is another one,
or the bytes were altered or moved -- raise :class:`UndecryptableChunk`, a ``ChunkNotFound``: a miss for that
reader, never garbage.  A reader keeps the replica (another process may hold the right key); the node that holds
the chunk drops it when it cannot open it itself.  Key material never appears in a repr, a log line, an error, an
etcd record or a metric; a :class:`Keyring` refuses to be pickled.
"""

import base64
import hmac
import logging
import os
import secrets
import stat
import time
from functools import lru_cache
from typing import Annotated

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from msgspec import Meta

from kvpool.core.config import Config, Rule, checked, validated
from kvpool.core.keys import check_key
from kvpool.errors import ConfigError, SetupError, UndecryptableChunk

log = logging.getLogger(__name__)

STAGE = "+aes256gcm"  #: ends the codec name of sealed stored bytes
MAGIC = b"KVE\x01"  # format version 1
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_PLAINTEXT = 2**31 - 1 - TAG_BYTES  # what cryptography's AES-GCM takes in one call
_SALT = b"kvpool aes256gcm v1"
_KEY_ID = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}"
_ENV_NAME = r"^([A-Za-z_][A-Za-z0-9_]*)?\Z"
_KEY_ID_RULE = "1-64 characters of letters, digits, '_', '.', ':' or '-', starting with a letter or digit"
_NEW_KEY = "kvpool keys new PATH"

Buffer = bytes | bytearray | memoryview
KeyId = Annotated[str, Meta(pattern=rf"^{_KEY_ID}\Z", description=_KEY_ID_RULE)]
KeyIdOrNone = Annotated[str, Meta(pattern=rf"^({_KEY_ID})?\Z", description=f"empty or {_KEY_ID_RULE}")]
#: 32 bytes (base64 text in a key file); never shown in an error
AesKey = Annotated[
    bytes,
    Meta(
        min_length=KEY_BYTES,
        max_length=KEY_BYTES,
        description=f"{KEY_BYTES} bytes, base64 in a key file ({_NEW_KEY} makes one)",
        extra={"secret": True},
    ),
]
Keys = Annotated[dict[KeyId, AesKey], Meta(min_length=1, description=f"one key or more ({_NEW_KEY} makes one)")]


def sealed_name(codec: str) -> str:
    """The stored codec name of bytes under ``codec``, sealed."""
    return codec + STAGE


def split(codec: str) -> tuple[str, bool]:
    """``(codec below the seal, whether sealed)`` of a stored codec name."""
    return (codec.removesuffix(STAGE), True) if codec.endswith(STAGE) else (codec, False)


class Keyring:
    """Key ids and their 32-byte AES-256 keys, and the id that seals new chunks (``current``: the last one given,
    unless named).  ``seal`` and ``open`` may be called from several threads at once.  Holds key material: its repr
    names the ids only, and pickling it is refused (send an :class:`EncryptionConfig`; each process loads the keys)."""

    __slots__ = ("_prks", "current")

    @checked
    def __init__(self, keys: Keys, current: KeyIdOrNone = "") -> None:
        self.current = current or list(keys)[-1]  #: the id that seals new chunks
        if self.current not in keys:
            raise ConfigError(f"key_id {self.current!r:.80} is not in the keyring (it holds {', '.join(keys)})")
        # HKDF-Extract once per key; a chunk's key is one HKDF-Expand block from it (see _cipher)
        self._prks = {key_id: hmac.digest(_SALT, key, "sha256") for key_id, key in keys.items()}

    @property
    def ids(self) -> list[str]:
        return list(self._prks)

    def __repr__(self) -> str:
        return f"Keyring(ids={self.ids}, current={self.current!r})"

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        raise ConfigError(
            "a Keyring holds key material and is not sent to other processes: pass its EncryptionConfig, from which "
            "each process loads the keys itself"
        )

    def seal(self, data: Buffer, chunk_key: bytes, codec: str, tenant: str = "") -> bytearray:
        """``data`` (stored bytes under ``codec``) sealed for ``chunk_key``: with the key whose id is ``tenant`` (the
        chunk's tenant: pool/tenants.py) when the keyring has one, else the current key."""
        key_id = tenant if tenant in self._prks else self.current
        prk = self._prks[key_id]
        plain = memoryview(data).cast("B")
        if plain.nbytes > MAX_PLAINTEXT:
            raise ConfigError(
                f"{plain.nbytes} bytes cannot be sealed in one piece (at most {MAX_PLAINTEXT}): use smaller chunks"
            )
        head = _head(key_id)
        nonce = secrets.token_bytes(NONCE_BYTES)
        out = bytearray(len(head) + NONCE_BYTES + plain.nbytes + TAG_BYTES)
        out[: len(head)] = head
        out[len(head) : len(head) + NONCE_BYTES] = nonce
        body = memoryview(out)[len(head) + NONCE_BYTES :]
        _cipher(prk, chunk_key).encrypt_into(nonce, plain, _associated(head, chunk_key, codec), body)
        return out

    def open(self, data: Buffer, chunk_key: bytes, codec: str) -> bytearray:
        """The bytes :meth:`seal` was given for ``chunk_key`` and ``codec``; ``UndecryptableChunk`` if these are not
        such bytes, or not sealed by a key of this keyring."""
        view = memoryview(data).cast("B")
        if len(view) < 5 or view[:4] != MAGIC:
            raise UndecryptableChunk(f"stored {codec + STAGE} bytes are not sealed bytes (bad magic or version)")
        n = view[4]
        start = 5 + n + NONCE_BYTES
        if len(view) < start + TAG_BYTES:
            raise UndecryptableChunk(f"sealed bytes truncated: {len(view)} bytes, at least {start + TAG_BYTES} needed")
        try:
            key_id = bytes(view[5 : 5 + n]).decode("ascii")
        except UnicodeDecodeError:
            raise UndecryptableChunk("sealed bytes: key id is not ASCII") from None
        prk = self._prks.get(key_id)
        if prk is None:
            raise UndecryptableChunk(
                f"chunk sealed with key id {key_id!r:.80}, which this process's keyring does not hold (it holds "
                f"{', '.join(self.ids)}): add that key to the key file, or treat the chunk as a miss"
            )
        out = bytearray(len(view) - start - TAG_BYTES)
        try:
            _cipher(prk, chunk_key).decrypt_into(
                bytes(view[5 + n : start]), view[start:], _associated(_head(key_id), chunk_key, codec), out
            )
        except InvalidTag:
            raise UndecryptableChunk(
                f"sealed chunk fails authentication under key id {key_id!r}: another key under that id, bytes "
                "altered, or bytes of another chunk"
            ) from None
        return out


def _head(key_id: str) -> bytes:
    name = key_id.encode("ascii")
    return MAGIC + bytes((len(name),)) + name


def _associated(head: bytes, chunk_key: bytes, codec: str) -> bytes:
    check_key(chunk_key, "chunk_key")
    return head + bytes((len(chunk_key),)) + chunk_key + codec.encode("ascii")


def _cipher(prk: bytes, chunk_key: bytes) -> AESGCM:
    """AES-256-GCM under the chunk's own key: HKDF-Expand's first block, ``HMAC(prk, "chunk" + key + 0x01)``."""
    return AESGCM(hmac.digest(prk, b"chunk" + chunk_key + b"\x01", "sha256"))


def seal(data: Buffer, chunk_key: bytes, codec: str, keys: "Keyring | None", tenant: str = "") -> tuple[Buffer, str]:
    """``data`` under ``codec`` sealed (see :meth:`Keyring.seal`), and its stored codec name; ``ConfigError``
    without keys."""
    if keys is None:
        raise ConfigError("sealing needs a keyring: set the tier's encryption (key_file or key_env)")
    return keys.seal(data, chunk_key, codec, tenant), sealed_name(codec)


def unseal(data: Buffer, codec: str, chunk_key: bytes, keys: "Keyring | None") -> tuple[Buffer, str]:
    """Stored bytes under ``codec`` opened if sealed, and the codec below the seal (unsealed: as they are)."""
    inner, sealed = split(codec)
    if not sealed:
        return data, codec
    if keys is None:
        raise UndecryptableChunk(
            f"chunk stored encrypted ({codec}) and this process has no keys: set encryption.key_file or key_env "
            "(the same keys as the pool's nodes) to read it"
        )
    return keys.open(data, chunk_key, inner), inner


# -- keys from a file or an environment variable -------------------------------------------------------------


class KeyLine(Config, frozen=True):
    """One line of a key file: ``<key id> <base64 key>``."""

    id: KeyId
    key: AesKey


def parse_keys(text: str, source: str) -> dict[str, bytes]:
    """Key ids and keys from a key file's text: one ``<key id> <base64 of 32 bytes>`` a line (a :class:`KeyLine`),
    ``#`` comments and blank lines ignored.  Errors name ``source`` and the line number, never the key."""
    keys: dict[str, bytes] = {}
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        where = f"{source}, line {number}"
        if not parts or parts[0].startswith("#"):
            continue
        if len(parts) != 2:
            raise ConfigError(f"{where}: expected '<key id> <base64 key>' ({_NEW_KEY} writes such lines)")
        entry = validated(KeyLine, dict(zip(("id", "key"), parts, strict=True)), where)
        if entry.id in keys:
            raise ConfigError(f"{where}: key id {entry.id!r} appears twice; give each key its own id")
        keys[entry.id] = entry.key
    if not keys:
        raise ConfigError(f"{source} holds no key: add one with {_NEW_KEY}")
    return keys


@checked
def new_key(path: str, key_id: KeyIdOrNone = "") -> str:
    """Append a fresh random key to the key file at ``path`` (created with mode 0600); its id (default
    ``k-<date>-<6 hex>``).  The last key of a file seals new chunks, so this also rotates the key: chunks sealed
    with the earlier ones still open while their lines stay."""
    key_id = key_id or f"k-{time.strftime('%Y%m%d')}-{secrets.token_hex(3)}"
    if os.path.exists(path):
        with open(path, encoding="ascii") as f:
            existing = f.read()
        if existing.strip() and key_id in parse_keys(existing, f"key file {path}"):
            raise ConfigError(f"key file {path} has a key {key_id!r} already: pick another id")
    else:
        existing = ""
    line = f"{key_id} {base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode('ascii')}\n"
    header = (
        "" if existing.strip() else "# kvpool keys: '<key id> <base64 key>' a line; the last one seals new chunks\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="ascii") as f:
        f.write(("\n" if existing and not existing.endswith("\n") else "") + header + line)
    return key_id


@lru_cache(maxsize=16)
def _load(key_file: str, stamp: tuple[int, int], key_env: str, env_text: str | None, key_id: str) -> Keyring:
    """A keyring, cached per source and its state (the file's mtime and size, the variable's text)."""
    if key_file:
        try:
            with open(key_file, encoding="ascii") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise SetupError(f"key file {key_file}: cannot read it ({type(exc).__name__}); check the path") from None
        if stat.S_IMODE(os.stat(key_file).st_mode) & 0o077:
            log.warning("key file %s is readable by others than its owner: chmod 600 it", key_file)
        source = f"key file {key_file}"
    else:
        if env_text is None:
            raise SetupError(f"key_env: environment variable {key_env} is not set; put the key file's text in it")
        text, source = env_text, f"environment variable {key_env}"
    return Keyring(parse_keys(text, source), key_id)


class EncryptionConfig(Config, frozen=True):
    """Encryption at rest of one tier: where its keys come from, and which one seals new chunks.

    Off unless ``key_file`` or ``key_env`` is set (one of them).  Holds no key material, only where to find it, so it
    can be logged, pickled to Ray actors and shown; every process loads the keys itself (:meth:`keyring`), so the
    key file must be at the same path on every node (or the variable set in every process's environment).
    """

    key_file: str = ""  #: a key file (``kvpool keys new PATH`` writes one)
    #: or: the name of an environment variable holding the key file's text
    key_env: Annotated[str, Meta(pattern=_ENV_NAME, description="the name of an environment variable")] = ""
    #: the key that seals new chunks; empty: the last one listed
    key_id: KeyIdOrNone = ""

    rules = (
        Rule("excludes", "key_file", "key_env", "the keys come from one of them"),
        Rule("needs", "key_id", "key_file or key_env", "it names a key of the key file (or variable): set one too"),
    )

    def check(self) -> None:
        self.keyring()  # everything about the keys is checked now, in the process that made the config

    @property
    def enabled(self) -> bool:
        return bool(self.key_file or self.key_env)

    def keyring(self) -> Keyring | None:
        """This process's keyring for the tier (None: encryption is off); ``ConfigError`` saying what is wrong with the
        key file or variable.  Loaded once, and again when the file changes."""
        if not self.enabled:
            return None
        stamp = (0, 0)
        if self.key_file:
            try:
                st = os.stat(self.key_file)
            except OSError:
                raise SetupError(
                    f"encryption.key_file {self.key_file!r}: no such file on host {os.uname().nodename}; make one "
                    f"with kvpool keys new {self.key_file}, and copy it to the same path on every node and client"
                ) from None
            stamp = (st.st_mtime_ns, st.st_size)
        env_text = os.environ.get(self.key_env) if self.key_env else None
        return _load(self.key_file, stamp, self.key_env, env_text, self.key_id)
