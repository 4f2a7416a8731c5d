"""The command line, run as a user runs it: the installed ``kvpool`` script in a subprocess.  The tables' layout
is checked in-process by tests/unit/test_cli_*.py; these check the script end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

from kvpool.core.types import NodeRecord, SegmentInfo, Tier
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.registry import NodeRegistry

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != ENDPOINTS_ENV} | {"COLUMNS": "160"} | (env or {})
    return subprocess.run([KVPOOL, *args], capture_output=True, text=True, timeout=300, env=full)


def test_up_on_the_embedded_default() -> None:
    """The README's main command: embedded etcd, a local Ray node, a PoolNode, a verified put/get, the
    prefill/decode demo (here on the small random model; test_smollm2 runs SmolLM2), status."""
    out = run("up", "--nodes", "1", "--dram-mib", "64", "--nvme-mib", "64", "--demo", "tiny-llama")
    assert out.returncode == 0, out.stderr
    assert "etcd      embedded, 127.0.0.1:" in out.stdout
    assert "ray       local, 1 node(s) on 127.0.0.2" in out.stdout
    assert "prefix lookup 16/16 chunks" in out.stdout and "verified" in out.stdout
    assert "cost      measured on this cluster" in out.stdout
    cold = next(line for line in out.stdout.splitlines() if "│ cold" in line)
    warm = next(line for line in out.stdout.splitlines() if "│ warm" in line)
    assert "recompute" in cold and "0 reused" in cold and "reload" in warm and "1280 reused" in warm
    assert "TTFT      cold" in out.stdout and "x faster" in out.stdout
    assert "/64M" in out.stdout and "chunks: 26" in out.stdout  # the check's 16 + 5 chunks of 2 groups of 4 layers


def test_status_of_a_running_pool(metadata_config: MetadataConfig, etcd: EtcdClient, namespace: Namespace) -> None:
    record = NodeRecord("n7", "127.0.0.3", 1, segments=(SegmentInfo("dram0", Tier.DRAM, 2 << 30, 1 << 30),))
    reg = NodeRegistry(etcd, namespace, 5).register(record)
    try:
        where = ["--cluster", metadata_config.cluster]
        env = {ENDPOINTS_ENV: metadata_config.endpoints[0], "COLUMNS": "80"}
        out = run("status", *where, env=env)
        assert out.returncode == 0, out.stderr
        assert max(map(len, out.stdout.splitlines())) <= 80
        assert next(line.split()[:6] for line in out.stdout.splitlines() if line.startswith("n7 ")) == [
            "n7",
            "127.0.0.3",
            "0B/2.0G",
            "-",
            "0",
            "-",
        ]
        wide = run("status", *where, "--wide", env={**env, "COLUMNS": "200"})
        assert "0.0 MiB / 2.00 GiB" in wide.stdout and "no segment" in wide.stdout
        (node,) = json.loads(run("status", *where, "--json", env=env).stdout)["nodes"]
        assert node["node_id"] == "n7" and node["dram"] == {"held": 0, "capacity": 2 << 30}
    finally:
        reg.close()


def test_errors_are_one_line_with_a_nonzero_exit() -> None:
    out = run("status", "--etcd", "127.0.0.1:9")
    assert out.returncode == 1
    assert "MetadataUnavailable" in out.stderr and "Traceback" not in out.stderr
    bad = run("status", "--etcd", "not-an-endpoint")
    assert bad.returncode == 1 and "ConfigError" in bad.stderr and "host:port" in bad.stderr
    no_etcd = run("join", "--ray-address", "127.0.0.2:6379")
    assert no_etcd.returncode == 1 and "ConfigError" in no_etcd.stderr and "--etcd" in no_etcd.stderr


def test_the_installed_script_explains_itself() -> None:
    """``kvpool`` as installed (tests/unit/test_cli_options.py checks every command's help in-process)."""
    out = run("--help")
    assert out.returncode == 0 and "Usage" in out.stdout and "vllm-config" in out.stdout


def test_etcd_command_serves_until_terminated(tmp_path: Path) -> None:
    """``kvpool etcd`` (the head node's metadata server in cluster.yaml) serves, and SIGTERM stops etcd too."""
    from kvpool.core.net import free_port

    port, peer = free_port("127.0.0.2"), free_port("127.0.0.2")
    proc = subprocess.Popen(
        [
            KVPOOL,
            "etcd",
            "--data-dir",
            str(tmp_path),
            "--host",
            "127.0.0.2",
            "--port",
            str(port),
            "--peer-port",
            str(peer),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        assert proc.stdout is not None and "etcd serving on 127.0.0.2" in proc.stdout.readline()
        client = EtcdClient(MetadataConfig(endpoints=(f"127.0.0.2:{port}",)))
        assert client.put(b"/k", b"v") > 1
        client.close()
        marker = f"http://127.0.0.2:{port}".encode()  # only the etcd binary's arguments hold the URL
        etcd_pids = [p.parent.name for p in Path("/proc").glob("[0-9]*/cmdline") if marker in _reads(p)]
        assert len(etcd_pids) == 1
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert not Path(f"/proc/{etcd_pids[0]}").exists()
        assert (tmp_path / "data" / "member").is_dir()  # the data stays for the next start
    finally:
        proc.kill()


def _reads(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile
        return b""
