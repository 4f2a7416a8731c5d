"""Encryption at rest (pool/tiers/crypto.py): sealing, keyrings, key files and their config — no servers."""

import base64
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
from msgspec.structs import replace

from kvpool.core.types import Tier
from kvpool.errors import ChunkNotFound, ConfigError, SetupError, UndecodableChunk
from kvpool.pool.chunks import Origin, StoredChunk, checksum
from kvpool.pool.config import PoolConfig
from kvpool.pool.node.moves import recode
from kvpool.pool.tiers.codecs import TensorFormat, codec_key, decode, parse_codec
from kvpool.pool.tiers.crypto import (
    KEY_BYTES,
    EncryptionConfig,
    Keyring,
    UndecryptableChunk,
    new_key,
    parse_keys,
    sealed_name,
    split,
)
from kvpool.pool.tiers.s3_config import RemoteConfig

KEY = bytes(range(32))  # a chunk key
BASES = ("raw", "raw+zstd", "fp8-e4m3", "fp8-e5m2/channel+zstd", "int4", "int4+delta+zstd")


def kv(seed: int = 0) -> torch.Tensor:
    return torch.randn((16, 2, 2, 32), generator=torch.Generator().manual_seed(seed))


def keyring(*ids: str, current: str = "") -> Keyring:
    return Keyring({i: os.urandom(KEY_BYTES) for i in ids or ("k1",)}, current)


def chunk_in_dram(data: bytes, fmt: TensorFormat | None, key: bytes = KEY) -> StoredChunk:
    return StoredChunk(key, Tier.DRAM, 0, stored=len(data), size=len(data), checksum=checksum(data), fmt=fmt)


def test_seal_open_round_trip_and_the_format() -> None:
    ring = keyring("a", "b")
    plain = os.urandom(5000)
    sealed = ring.seal(plain, KEY, "raw")
    assert bytes(sealed[:4]) == b"KVE\x01" and bytes(sealed[5:6]) == b"b"  # the current key: the last one
    assert len(sealed) == 4 + 1 + 1 + 12 + len(plain) + 16 and plain not in bytes(sealed)
    assert bytes(ring.open(sealed, KEY, "raw")) == plain
    assert bytes(ring.open(ring.seal(b"", KEY, "raw", tenant="a"), KEY, "raw")) == b""
    assert ring.seal(plain, KEY, "raw") != sealed  # a fresh random nonce every time


@pytest.mark.parametrize("base", BASES)
def test_tensors_and_bytes_round_trip_under_each_base_codec_sealed(base: str) -> None:
    ring, t = keyring(), kv()
    data = t.view(torch.uint8).numpy().tobytes()
    down = recode(chunk_in_dram(data, TensorFormat.of(t)), data, sealed_name(base), ring)
    assert down is not None and down.codec == sealed_name(parse_codec(base).name)
    assert down.checksum == checksum(down.data)  # the pool's checksum is of the stored, sealed bytes
    stored = StoredChunk(KEY, Tier.NVME, 0, len(down.data), len(data), down.checksum, down.codec, down.fmt)
    up = recode(stored, down.data, "raw", ring)
    assert up is not None and up.codec == "raw" and len(up.data) == len(data)
    back = torch.frombuffer(bytearray(up.data), dtype=torch.float32).view(t.shape)
    assert (back - t).abs().max() <= (0.3 if "int4" in base else 0.07) * t.abs().max()
    if parse_codec(base).lossless:
        assert bytes(up.data) == data
    # a chunk put as plain bytes has no format: whatever the tier's codec, it is sealed raw
    plain = os.urandom(3000)
    down = recode(chunk_in_dram(plain, None), plain, sealed_name(base), ring)
    assert down is not None and down.codec == "raw+aes256gcm" and plain not in bytes(down.data)
    stored = StoredChunk(KEY, Tier.NVME, 0, len(down.data), len(plain), down.checksum, down.codec)
    up = recode(stored, down.data, "raw", ring)
    assert up is not None and bytes(up.data) == plain and up.checksum == checksum(plain)


def test_a_wrong_or_missing_key_is_a_miss_never_garbage() -> None:
    ring = keyring("k1")
    sealed = ring.seal(b"secret prompt KV" * 100, KEY, "raw")
    other = keyring("k1")  # the same id, another key
    with pytest.raises(UndecryptableChunk, match="fails authentication under key id 'k1'"):
        other.open(sealed, KEY, "raw")
    with pytest.raises(UndecryptableChunk, match="does not hold") as missing:
        keyring("k2").open(sealed, KEY, "raw")
    assert isinstance(missing.value, ChunkNotFound) and not isinstance(missing.value, UndecodableChunk)
    # at a node, a chunk it cannot open is dropped (recode: None), not moved
    stored = StoredChunk(KEY, Tier.NVME, 0, len(sealed), 1600, checksum(sealed), "raw+aes256gcm")
    assert recode(stored, sealed, "raw", other) is None
    assert recode(stored, sealed, "raw", None) is None
    # nor decoded as if it were a codec's output
    with pytest.raises(UndecodableChunk, match="sealed bytes: open them first"):
        decode(sealed)


def test_a_flipped_byte_anywhere_is_a_miss() -> None:
    ring = keyring()
    sealed = ring.seal(os.urandom(1000), KEY, "raw")
    for at in (5, 8, 20, len(sealed) // 2, len(sealed) - 1):  # key id, nonce, ciphertext, tag
        bad = bytearray(sealed)
        bad[at] ^= 0x01
        with pytest.raises(UndecryptableChunk):
            ring.open(bad, KEY, "raw")
    for bad in (sealed[:20], b"", b"KVC\x01" + bytes(sealed[4:])):
        with pytest.raises(UndecryptableChunk):
            ring.open(bad, KEY, "raw")


def test_ciphertext_is_bound_to_its_chunk_key_and_codec() -> None:
    ring = keyring()
    sealed = ring.seal(os.urandom(1000), KEY, "fp8-e4m3")
    with pytest.raises(UndecryptableChunk):
        ring.open(sealed, bytes(reversed(KEY)), "fp8-e4m3")  # moved under another chunk's key
    with pytest.raises(UndecryptableChunk):
        ring.open(sealed, KEY, "raw")  # presented as another codec
    assert ring.open(sealed, KEY, "fp8-e4m3")


def test_reseal_from_one_keyring_to_another_as_a_flush_does() -> None:
    nvme, s3 = keyring("n"), keyring("s")
    plain = os.urandom(2000)
    on_nvme = nvme.seal(plain, KEY, "raw")
    chunk = StoredChunk(KEY, Tier.NVME, 0, len(on_nvme), len(plain), checksum(on_nvme), "raw+aes256gcm")
    up = recode(chunk, on_nvme, "raw+aes256gcm", s3, source_keys=nvme)
    assert up is not None and up.codec == "raw+aes256gcm"
    assert bytes(s3.open(up.data, KEY, "raw")) == plain
    clear = recode(chunk, on_nvme, "raw", None, source_keys=nvme)  # the remote tier not encrypted: opened, stored plain
    assert clear is not None and bytes(clear.data) == plain and clear.codec == "raw"


def test_a_tenants_chunks_are_sealed_with_the_tenants_own_key() -> None:
    """A key whose id is a tenant's name seals that tenant's chunks; the others get the current key.  Without the
    tenant's key (its line deleted: a crypto-shred) its chunks are misses, the others still open."""
    k1, acme = os.urandom(KEY_BYTES), os.urandom(KEY_BYTES)
    ring = Keyring({"acme": acme, "k1": k1}, "k1")
    plain = os.urandom(1000)
    own = recode(replace(chunk_in_dram(plain, None), origin=Origin("acme")), plain, "raw+aes256gcm", ring)
    other = recode(replace(chunk_in_dram(plain, None), origin=Origin("globex")), plain, "raw+aes256gcm", ring)
    assert own is not None and other is not None
    assert bytes(own.data).find(b"acme") > 0 and bytes(other.data).find(b"acme") < 0  # the header names the key id
    shredded = Keyring({"k1": k1}, "k1")
    with pytest.raises(UndecryptableChunk):
        shredded.open(own.data, KEY, "raw")
    assert bytes(shredded.open(other.data, KEY, "raw")) == plain


def test_sealed_codec_names() -> None:
    assert split("int4+zstd+aes256gcm") == ("int4+zstd", True) and split("int4") == ("int4", False)
    assert codec_key(KEY, "raw+aes256gcm") not in (KEY, codec_key(KEY, "raw+zstd"))
    assert codec_key(KEY, "INT4:g32+aes256gcm") == codec_key(KEY, "int4+aes256gcm")
    with pytest.raises(ConfigError, match="encryption is not a codec stage"):
        parse_codec("fp8-e4m3+aes256gcm")


def key_line(key_id: str, key: bytes) -> str:
    return f"{key_id} {base64.b64encode(key).decode()}\n"


def test_key_files_new_and_rotation(tmp_path: Path) -> None:
    path = str(tmp_path / "keys")
    first = new_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert new_key(path, "tenant:acme") == "tenant:acme"
    with pytest.raises(ConfigError, match="already"):
        new_key(path, "tenant:acme")
    config = EncryptionConfig(key_file=path)
    ring = config.keyring()
    assert ring is not None and ring.ids == [first, "tenant:acme"] and ring.current == "tenant:acme"
    pinned = EncryptionConfig(key_file=path, key_id=first).keyring()
    assert pinned is not None and pinned.current == first
    sealed = pinned.seal(b"x" * 64, KEY, "raw")
    new_key(path)  # rotation: the file changed, the keyring is loaded again; old chunks still open
    rotated = config.keyring()
    assert rotated is not None and len(rotated.ids) == 3 and rotated.current not in (first, "tenant:acme")
    assert bytes(rotated.open(sealed, KEY, "raw")) == b"x" * 64


def test_keys_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    key = os.urandom(KEY_BYTES)
    monkeypatch.setenv("KVPOOL_TEST_KEYS", key_line("env1", key))
    ring = EncryptionConfig(key_env="KVPOOL_TEST_KEYS").keyring()
    assert ring is not None and ring.ids == ["env1"]
    assert bytes(Keyring({"env1": key}).open(ring.seal(b"abc", KEY, "raw"), KEY, "raw")) == b"abc"
    monkeypatch.delenv("KVPOOL_TEST_KEYS")
    with pytest.raises(SetupError, match="KVPOOL_TEST_KEYS is not set"):
        EncryptionConfig(key_env="KVPOOL_TEST_KEYS")


def test_config_is_checked_with_errors_that_say_what_to_do(tmp_path: Path) -> None:
    good = os.urandom(KEY_BYTES)

    def file(text: str) -> str:
        path = tmp_path / f"k{len(list(tmp_path.iterdir()))}"
        path.write_text(text)
        return str(path)

    cases = [
        ({"key_file": str(tmp_path / "none")}, "no such file on host .*; make one with kvpool keys new"),
        ({"key_file": file("# only a comment\n")}, "holds no key"),
        ({"key_file": file("k1\n")}, "line 1: expected '<key id> <base64 key>'"),
        ({"key_file": file(key_line("k1", good[:16]))}, "line 1: `key` must be 32 bytes, base64 in a key file"),
        ({"key_file": file("k1 not*base64\n")}, "line 1: `key` must be 32 bytes.*invalid base64"),
        ({"key_file": file(key_line("-bad", good))}, "line 1: `id` must be 1-64 characters"),
        ({"key_file": file(key_line("k1", good) * 2)}, "line 2: key id 'k1' appears twice"),
        ({"key_file": file(key_line("k1", good)), "key_id": "k2"}, "key_id 'k2' is not in the keyring"),
        ({"key_file": file(key_line("k1", good)), "key_env": "X"}, "key_file or key_env, not both"),
        ({"key_id": "k1"}, "key_id is set but key_file or key_env is not: it names a key of the key file"),
        ({"key_env": "not a name"}, "the name of an environment variable"),
        ({"key_file": 3}, "`key_file` expected `str`, got int 3"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SetupError if "no such file" in message else ConfigError, match=message) as caught:
            EncryptionConfig(**kwargs)  # type: ignore[arg-type]
        assert base64.b64encode(good).decode() not in str(caught.value)
    with pytest.raises(
        ConfigError, match="`encryption` expected EncryptionConfig, got str 'keys': write encryption=EncryptionConfig"
    ):
        PoolConfig(encryption="keys")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match="`encryption` expected EncryptionConfig, got str 'keys': write encryption=EncryptionConfig"
    ):
        RemoteConfig(encryption="keys")  # type: ignore[arg-type]


def test_no_key_material_in_reprs_errors_or_pickles(tmp_path: Path) -> None:
    key = os.urandom(KEY_BYTES)
    path = tmp_path / "keys"
    path.write_text(key_line("k1", key))
    encryption = EncryptionConfig(key_file=str(path))
    ring = encryption.keyring()
    assert ring is not None
    shown = [
        repr(encryption),
        str(encryption),
        repr(ring),
        str(ring),
        repr(PoolConfig(encryption=encryption)),
        repr(RemoteConfig(encryption=encryption)),
        str(pickle.loads(pickle.dumps(encryption))),
    ]
    for text in shown:
        for form in (base64.b64encode(key).decode(), key.hex(), repr(key)[2:-1]):
            assert form not in text
    assert "k1" in repr(ring)
    with pytest.raises(ConfigError, match="not sent to other processes"):
        pickle.dumps(ring)
    try:
        Keyring({"k1": key}).open(b"KVE\x01\x02k2" + bytes(40), KEY, "raw")
    except UndecryptableChunk as exc:
        assert base64.b64encode(key).decode() not in str(exc) and key.hex() not in str(exc)
    assert parse_keys(key_line("k1", key), "test") == {"k1": key}


def test_kvpool_keys_new(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvpool.cli import app

    path = tmp_path / "keys"
    out = CliRunner().invoke(app, ["keys", "new", str(path), "--id", "t1"])
    assert out.exit_code == 0 and "key t1 added" in out.output
    [key] = parse_keys(path.read_text(), "test").values()
    assert base64.b64encode(key).decode() not in out.output
    again = CliRunner().invoke(app, ["keys", "new", str(path), "--id", "t1"])
    assert again.exit_code == 1 and "pick another id" in again.output
