"""``kvpool advise`` on access logs written by ``AccessLog`` (two processes on two nodes, one sample): lookups are
read back whole with their node, the table's rows agree with the per-node curve, more DRAM never predicts fewer
hits, a codec stretches NVMe, the PNG is written; logs of the older one-key format still read; bad logs and bad
options are one-line errors."""

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from kvpool.cli import app
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.pool.advisor import AccessLog, curve_of_log, read_access_logs

runner = CliRunner()
KIB = 1 << 10


def write_logs(directory: Path) -> None:
    """Two processes' lookups (on two nodes) of 200 documents (16 chunks of 256 KiB) with Zipf popularity, sampled
    at 0.5."""
    rng = np.random.default_rng(3)
    ident = CacheIdentity(model="advise", kv_dtype="u8", layout="b", chunk_size=1)
    docs = [chunk_keys(ident, [d] * 16) for d in range(200)]
    popularity = 1 / np.arange(1, 201) ** 0.9
    for part in range(2):
        log = AccessLog(str(directory), rate=0.5)
        log.path, log.node = str(directory / f"access-test-{part}.jsonl"), f"node{part}"
        for d in rng.choice(200, 1500, p=popularity / popularity.sum()):
            log.record(docs[d], lambda k: 256 * KIB if k[0] % 4 else 0)  # some looked up while not held
        log.close()


def test_advise_predicts_from_sampled_logs(tmp_path: Path) -> None:
    write_logs(tmp_path)
    logs = sorted(str(p) for p in tmp_path.glob("access-*.jsonl"))
    log = read_access_logs(logs)
    accesses, total = log.accesses, log.total
    assert log.rate == 0.5 and total == 2 * 1500 * 16 and 0.4 * total < len(accesses) < 0.6 * total
    assert log.nodes == ("node0", "node1") and len(log.lookups) <= 2 * 1500
    assert all(size == 256 * KIB for _, size in accesses)  # unknown sizes take the size seen elsewhere
    curve = curve_of_log(log, logged_at=0.5 * 2**30)
    assert curve.nodes == 2
    png = tmp_path / "mrc.png"
    args = ["advise", *logs, "--dram-gib", "0.25", "--nvme-gib", "0.25", "--png", str(png)]
    out = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.stdout
    rows = {line.split("│")[1].strip(): line for line in out.stdout.splitlines() if line.count("│") > 5}
    assert {"now", "DRAM +0.0625 GiB", "DRAM -0.0625 GiB", "NVMe +0.0625 GiB", "NVMe -0.0625 GiB"} <= set(rows)
    now_dram = float(rows["now"].split("│")[4].strip().rstrip("%"))
    assert abs(now_dram - 100 * curve.hit_ratio(0.25 * 2**30)) < 0.06
    assert "2 nodes, one LRU stack each" in out.stdout
    more = float(rows["DRAM +0.0625 GiB"].split("│")[4].strip().rstrip("%"))
    assert more >= now_dram
    assert any(name.startswith("NVMe codec int4") for name in rows)
    assert png.stat().st_size > 1000 and "ceiling" in out.stdout
    assert "prefill saved" not in out.stdout

    priced = runner.invoke(app, [*args, "--model", "llama-3-8b"], env={"COLUMNS": "250"})
    assert priced.exit_code == 0, priced.stdout
    saved = {
        line.split("│")[1].strip(): float(line.split("│")[7].strip().rstrip(" s").replace(",", ""))
        for line in priced.stdout.splitlines()
        if line.count("│") > 6
    }
    assert saved["DRAM +0.0625 GiB"] >= saved["now"] > saved["DRAM -0.0625 GiB"] > 0
    assert "llama-3-8b on reference analysis figures" in priced.stdout
    slow = runner.invoke(app, [*args, "--model", "llama-3-8b", "--nvme-gbps", "0.001"], env={"COLUMNS": "250"})
    slow_saved = {
        line.split("│")[1].strip(): line.split("│")[7].strip()
        for line in slow.stdout.splitlines()
        if line.count("│") > 6
    }
    assert slow_saved["NVMe +0.0625 GiB"].startswith("-")  # a disk slower than computing costs time


def test_one_stack_and_logs_of_the_older_format(tmp_path: Path) -> None:
    write_logs(tmp_path)
    logs = sorted(str(p) for p in tmp_path.glob("access-*.jsonl"))
    args = ["--dram-gib", "0.25", "--nvme-gib", "0.25", "--png", str(tmp_path / "mrc.png")]
    one = runner.invoke(app, ["advise", *logs, *args, "--one-stack"], env={"COLUMNS": "200"})
    assert one.exit_code == 0, one.stdout
    assert "one LRU stack)" in one.stdout
    old = tmp_path / "access-old.jsonl"  # one line per sampled key, no node: each key a lookup of its own
    with old.open("w") as f:
        for _, items in read_access_logs(logs[:1]).lookups:
            f.writelines(json.dumps({"t": 1.0, "key": k.hex(), "size": size}) + "\n" for k, size in items)
        f.write(json.dumps({"t": 2.0, "accesses": 24000, "rate": 0.5}) + "\n")
    log = read_access_logs([str(old)])
    assert log.nodes == ("",) and all(len(items) == 1 for _, items in log.lookups) and log.total == 24000
    out = runner.invoke(app, ["advise", str(old), *args], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.stdout
    assert "one LRU stack)" in out.stdout


def test_help_says_what_the_model_assumes() -> None:
    out = runner.invoke(app, ["advise", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0
    assert "prefix rule" in out.stdout and "own LRU stack" in out.stdout and "--one-stack" in out.stdout
    assert "concurrent lookup" in out.stdout


def test_bad_logs_and_options_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "access-x.jsonl"
    bad.write_text('{"t": 1, "key": "zz", "size": 3}\n')
    out = runner.invoke(app, ["advise", str(bad)])
    assert out.exit_code == 1 and "not an access-log line" in out.output
    bad.write_text('{"t": 1, "keys": ["00"], "sizes": [1, 2]}\n')
    out = runner.invoke(app, ["advise", str(bad)])
    assert out.exit_code == 1 and "1 keys but 2 sizes" in out.output
    (tmp_path / "ok").mkdir()
    write_logs(tmp_path / "ok")
    good = sorted(str(p) for p in (tmp_path / "ok").glob("access-*.jsonl"))
    out = runner.invoke(app, ["advise", *good, "--codec", "fp8", "--dram-gib", "1", "--nvme-gib", "1"])
    assert out.exit_code == 1 and "NAME=RATIO" in out.output
    out = runner.invoke(app, ["advise", *good], env={"KVPOOL_ETCD_ENDPOINTS": ""})
    assert out.exit_code == 1 and "or --etcd: the etcd of a running pool" in out.output
