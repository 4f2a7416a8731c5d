"""Cache identities, pure: what two identities of one model disagree on, their etcd record, and how ``kvpool
status`` shows them (the "zero hits across instances" trap named, TP ranks of one engine not)."""

import msgspec
import pytest
from rich.console import Console

from kvpool.cli import status
from kvpool.cli.status import IdentityStatus, PoolStatus, RemoteTier
from kvpool.core.keys import CacheIdentity
from kvpool.core.types import IdentityRecord
from kvpool.errors import MalformedRecord
from kvpool.metadata.identities import disagreements, fingerprint
from kvpool.metadata.records import decode_identity, encode_identity

BF16 = CacheIdentity(model="llama", kv_dtype="bfloat16", layout="groups-of-4", chunk_size=256, tp_size=2)


def record(identity: CacheIdentity) -> IdentityRecord:
    return IdentityRecord(identity, "host-a", 4242, 1.7e9)


def test_ranks_of_one_engine_agree_and_another_dtype_or_block_size_does_not() -> None:
    ranks = [record(BF16), record(msgspec.structs.replace(BF16, tp_rank=1))]
    assert disagreements(ranks) == []
    other = record(msgspec.structs.replace(BF16, kv_dtype="float16", chunk_size=16))
    elsewhere = record(CacheIdentity(model="smollm", kv_dtype="float16", layout="per-layer"))
    [said] = disagreements([*ranks, other, elsewhere])
    assert said.startswith("model llama is cached under 2 identities that differ in kv_dtype: bfloat16, float16; ")
    assert "chunk_size: 16, 256" in said and "zero hits" in said and "smollm" not in said


def test_an_identity_record_round_trips_and_a_bad_one_is_malformed() -> None:
    r = record(BF16)
    assert decode_identity(encode_identity(r)) == r
    assert len(fingerprint(BF16)) == 16 and fingerprint(BF16) == BF16.root().hex()[:16]
    bad = encode_identity(record(msgspec.structs.replace(BF16, tp_rank=1))).replace(
        b"\xa7tp_rank\x01", b"\xa7tp_rank\x05"
    )
    with pytest.raises(MalformedRecord, match="tp_rank"):
        decode_identity(bad)
    with pytest.raises(MalformedRecord):
        decode_identity(b"\x00junk")


def test_status_counts_identities_lists_them_wide_and_always_shows_the_warning() -> None:
    ids = (
        IdentityStatus("0123456789abcdef", "llama", "bfloat16", "groups-of-4", 256, "0/1", "raw", "host-a", 90.0),
        IdentityStatus("fedcba9876543210", "llama", "float16", "groups-of-4", 256, "0/1", "raw", "host-b", 30.0),
    )
    snap = PoolStatus(
        "default",
        ("127.0.0.1:2379",),
        9,
        (),
        0,
        0,
        0,
        RemoteTier(0, 0, 0, ()),
        ids,
        ("model llama is cached under 2 identities that differ in kv_dtype: bfloat16, float16: ...",),
    )

    def text(wide: bool) -> str:
        console = Console(width=160, record=True, color_system=None)
        console.print(status.render(snap, wide))
        return console.export_text()

    compact, wide = text(False), text(True)
    assert "cache identities in use: 2 (--wide lists them)" in compact and "warning: model llama" in compact
    assert "0123456789abcdef" in wide and "float16" in wide and "host-b" in wide and "warning: model llama" in wide
