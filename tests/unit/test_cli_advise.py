"""``kvpool advise`` on access logs written by ``AccessLog`` (two processes' worth, one sample): the table's rows
agree with the curve, more DRAM never predicts fewer hits, a codec stretches NVMe, the PNG is written; bad logs
and bad options are one-line errors."""

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from kvpool.cli import app
from kvpool.pool.advisor import AccessLog, curve_of_log, read_access_logs
from kvpool.pool.keys import CacheIdentity, chunk_keys

runner = CliRunner()
KIB = 1 << 10


def write_logs(directory: Path) -> None:
    """Two processes' lookups of 200 documents (16 chunks of 256 KiB) with Zipf popularity, sampled at 0.5."""
    rng = np.random.default_rng(3)
    ident = CacheIdentity(model="advise", kv_dtype="u8", layout="b", chunk_size=1)
    docs = [chunk_keys(ident, [d] * 16) for d in range(200)]
    popularity = 1 / np.arange(1, 201) ** 0.9
    for part in range(2):
        log = AccessLog(str(directory), rate=0.5)
        log.path = str(directory / f"access-test-{part}.jsonl")
        for d in rng.choice(200, 1500, p=popularity / popularity.sum()):
            log.record(docs[d], lambda k: 256 * KIB if k[0] % 4 else 0)  # some looked up while not held
        log.close()


def test_advise_predicts_from_sampled_logs(tmp_path: Path) -> None:
    write_logs(tmp_path)
    logs = sorted(str(p) for p in tmp_path.glob("access-*.jsonl"))
    rate, accesses, total = read_access_logs(logs)
    assert rate == 0.5 and total == 2 * 1500 * 16 and 0.4 * total < len(accesses) < 0.6 * total
    assert all(size == 256 * KIB for _, size in accesses)  # unknown sizes take the size seen elsewhere
    curve = curve_of_log(rate, accesses, total)
    png = tmp_path / "mrc.png"
    args = ["advise", *logs, "--dram-gib", "0.25", "--nvme-gib", "0.25", "--png", str(png)]
    out = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.stdout
    rows = {line.split("│")[1].strip(): line for line in out.stdout.splitlines() if line.count("│") > 5}
    assert {"now", "DRAM +0.0625 GiB", "DRAM -0.0625 GiB", "NVMe +0.0625 GiB", "NVMe -0.0625 GiB"} <= set(rows)
    now_dram = float(rows["now"].split("│")[4].strip().rstrip("%"))
    assert abs(now_dram - 100 * curve.hit_ratio(0.25 * 2**30)) < 0.06
    more = float(rows["DRAM +0.0625 GiB"].split("│")[4].strip().rstrip("%"))
    assert more >= now_dram
    assert any(name.startswith("NVMe codec int4") for name in rows)
    assert png.stat().st_size > 1000 and "ceiling" in out.stdout
    assert "prefill saved" not in out.stdout

    priced = runner.invoke(app, [*args, "--model", "llama-3-8b"], env={"COLUMNS": "250"})
    assert priced.exit_code == 0, priced.stdout
    saved = {line.split("│")[1].strip(): float(line.split("│")[7].strip().rstrip(" s").replace(",", ""))
             for line in priced.stdout.splitlines() if line.count("│") > 6}  # fmt: skip
    assert saved["DRAM +0.0625 GiB"] >= saved["now"] > saved["DRAM -0.0625 GiB"] > 0
    assert "llama-3-8b on reference analysis figures" in priced.stdout
    slow = runner.invoke(app, [*args, "--model", "llama-3-8b", "--nvme-gbps", "0.001"], env={"COLUMNS": "250"})
    slow_saved = {
        line.split("│")[1].strip(): line.split("│")[7].strip()
        for line in slow.stdout.splitlines()
        if line.count("│") > 6
    }
    assert slow_saved["NVMe +0.0625 GiB"].startswith("-")  # a disk slower than computing costs time


def test_bad_logs_and_options_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "access-x.jsonl"
    bad.write_text('{"t": 1, "key": "zz", "size": 3}\n')
    out = runner.invoke(app, ["advise", str(bad)])
    assert out.exit_code == 1 and "not an access-log line" in out.output
    (tmp_path / "ok").mkdir()
    write_logs(tmp_path / "ok")
    good = sorted(str(p) for p in (tmp_path / "ok").glob("access-*.jsonl"))
    out = runner.invoke(app, ["advise", *good, "--codec", "fp8", "--dram-gib", "1", "--nvme-gib", "1"])
    assert out.exit_code == 1 and "NAME=RATIO" in out.output
    out = runner.invoke(app, ["advise", *good], env={"KVPOOL_ETCD_ENDPOINTS": ""})
    assert out.exit_code == 1 and "--etcd of a running pool" in out.output
