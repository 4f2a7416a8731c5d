"""The command line's tables, rendered in-process from constructed data: ``ls``, ``bench``, and ``up``'s check and demo."""

import shlex

from rich.console import Console

from kvpool.bench.cluster import Results
from kvpool.cli.bench import render_bench
from kvpool.cli.chunks import chunks_table
from kvpool.cli.up import check_line, demo_lines, demo_table, shell_exports
from kvpool.core.types import Placement, Tier
from kvpool.metadata.config import MetadataConfig
from kvpool.prefill_decode.reference.demo import DemoRun
from kvpool.prefill_decode.reference.service import Completion
from kvpool.prefill_decode.reference.workers import DecodeResult, PrefillResult, PrefillSummary
from kvpool.stack import PoolCheck


def text(renderable: object, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def cells(out: str, first: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(f"│ {first}"))
    return [c.strip() for c in line.split("│")[1:-1]]


def test_ls_sorts_by_key_and_shows_every_replica() -> None:
    def at(key: bytes, node: str, tier: Tier, offset: int, identity: str = "") -> Placement:
        return Placement(key, node, tier, offset=offset, stored=8192, size=8192, checksum=0xBEEF, identity=identity)

    a, b = bytes([1] * 32), bytes([2] * 32)
    chunks = [
        (b, [at(b, "node-b" * 3, Tier.NVME, 4096, identity="0123456789abcdef")]),
        (a, [at(a, "node-a", Tier.DRAM, 0), at(a, "s3", Tier.REMOTE, 0)]),
    ]
    out = text(chunks_table(chunks, "2 chunks", limit=50))
    assert cells(out, "0101") == [
        "0101010101010101",
        "8192",
        "node-a: dram @ 0, s3: remote @ 0",
        "raw",
        "0000beef",
        "-",
    ]
    assert cells(out, "0202")[2] == "node-bnode-b: nvme @ 4096"  # node ids cut to 12 characters
    assert cells(out, "0202")[5] == "0123456789abcdef"  # the cache identity it was put under
    assert "0202" not in text(chunks_table(chunks, "2 chunks", limit=1))


def test_bench_results() -> None:
    results = Results(
        nodes=["n1" * 8, "n2" * 8],
        hosts=["127.0.0.2", "127.0.0.3"],
        settings={"chunks_per_cell": 16, "size": 4 * 2**20, "ttft_model": "tiny-llama"},
        limits={"memcpy": 5.2, "socket": 1.9, "disk_write": 0.5, "disk_read": 2.7},
        put=[[1.3, 0.9], [0.8, 1.2]],
        get={"dram": [[2.5, 1.5], [1.6, 2.9]]},
        scaling=[{"readers": 1, "aggregate_gbps": 1.5, "per_reader_gbps": 1.5}],
        ttft=[
            {"tokens": 1024, "cold_s": 0.33, "warm_s": 0.032, "speedup": 10.3, "reused_tokens": 1024, "same_token": 1.0}
        ],
    )
    out = text(render_bench(results))
    flat = " ".join(out.split())  # titles wrap over narrow tables
    assert "limits memcpy (1 thread) 5.20 GB/s · TCP loopback 1.90 GB/s" in flat
    assert "put GB/s: writer (row) into holder (column); 16 x 4 MiB chunks" in flat
    assert cells(out, "127.0.0.2")[1:] == ["1.30", "0.90"]  # the put grid comes first
    assert "get dram GB/s" in flat and "│ 1 │ 1.50 │ 1.50 │ 5.20 │ 1.90 │" in flat
    assert "│ 1,024 │ 0.330 │ 0.032 │ 10.3x │ 1,024 │ yes │" in flat


def completion(reused: int, computed: int, ttft_s: float, tokens: list[int]) -> Completion:
    summary = PrefillSummary(
        node_id="n",
        prompt_tokens=reused + computed,
        action="reload" if reused else "recompute",
        decision="",
        reused_tokens=reused,
        computed_tokens=computed,
        fell_back=False,
        seconds=ttft_s,
        sources={"dram@n1": 2**20} if reused else {},
    )
    prefill = PrefillResult(first_token=tokens[0], ttft_s=ttft_s, summary=summary, saved_bytes=0, revision=1)
    decode = DecodeResult(tokens=tokens, summary=summary, decode_s=0.1)
    return Completion(list(range(reused + computed)), tokens, ttft_s, ttft_s + 0.1, prefill, decode)


def test_up_demo_and_check() -> None:
    run = DemoRun(1500, completion(0, 1500, 0.9, [1, 2]), completion(1280, 220, 0.1, [1, 3]), answer="p3, 11 min")
    out = text(demo_table(run))
    assert cells(out, "cold")[:3] == ["cold", "0.900", "recompute"] and "0 reused (-)" in cells(out, "cold")[3]
    assert cells(out, "warm")[3] == "1280 reused (1.0 MiB dram@n1), 220 computed"
    lines = demo_lines(run)
    assert lines[0] == "TTFT      cold 0.900 s, warm 0.100 s: 9.0x faster"
    assert lines[2] == "answer    p3, 11 min" and "differs" in lines[3]
    check = PoolCheck(chunks=16, chunk_bytes=2**20, found=16, put_s=0.05, get_s=0.02, verified=True)
    assert text(check_line(check)).strip() == (
        "check     put 16 MiB in 50 ms, prefix lookup 16/16 chunks, got 16 MiB back in 20 ms: verified"
    )


def test_up_hold_s_export_line_sets_what_a_user_s_ray_init_and_from_env_read() -> None:
    """What another shell runs first: Ray's address, its mode and token file (a path with a space stays one word),
    etcd's endpoints; no token path where the cluster runs without authentication."""
    metadata = MetadataConfig(endpoints=("127.0.0.1:2379", "127.0.0.1:2381"))
    line = shell_exports("127.0.0.2:6379", "token", "/tmp/kvpool ray/auth_token", metadata)
    words = shlex.split(line)
    assert words[0] == "export" and dict(w.split("=", 1) for w in words[1:]) == {
        "RAY_ADDRESS": "127.0.0.2:6379",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": "/tmp/kvpool ray/auth_token",
        "KVPOOL_ETCD_ENDPOINTS": "127.0.0.1:2379,127.0.0.1:2381",
    }
    assert "RAY_AUTH_TOKEN_PATH" not in shell_exports("127.0.0.2:6379", "disabled", "", metadata)
