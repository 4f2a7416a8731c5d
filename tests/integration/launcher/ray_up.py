"""``ray up cluster.yaml`` for real, on this one machine: two "machines" on loopback, reached over ssh.

Every ssh connection Ray makes goes through ``auth.ssh_proxy_command``: an ``sshd -i`` started on the
pipe, so no port listens and nothing outside this run can log in.  The cluster is the repository's
cluster.yaml with only what a single machine forces changed: addresses (127.0.0.20, 127.0.0.21),
ports, small capacities, and ``setup_commands`` that link this checkout's venv instead of installing
kvpool again.  Each "machine" gets ``HOME`` in a temp dir and ``KVPOOL_NODE_IP`` from sshd's
``SetEnv``.  The script then waits for both PoolNodes, puts a file with ``kvpool put``, reads it back
with ``kvpool get`` from the other node's copy, runs ``kvpool status`` on the head through
``ray exec`` (which must show both nodes' Ray running with the token ``kvpool ray-token`` made here and
file_mounts shipped), and tears down what it started: ``kvpool down``, then every process carrying this run's
marker in its environment.  It never runs ``ray stop`` or ``ray down``: both stop every Ray on the box.

    python tests/integration/launcher/ray_up.py [--keep]     # exit 0: passed; 77: cannot run here (says why)

Needs root (``sshd -i`` logs in as the current user and must own its host key), ``sshd``, ``ssh``,
``ssh-keygen`` and ``rsync`` (``make test`` installs openssh-server and rsync when it can).
"""

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import yaml

from kvpool.core.net import free_port
from kvpool.metadata.config import MetadataConfig

ROOT = Path(__file__).resolve().parents[3]
HEAD, WORKER = "127.0.0.20", "127.0.0.21"
SKIP = 77
MARK = "KVPOOL_RAY_UP_RUN"


def log(msg: str) -> None:
    print(f"[ray_up {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin")  # sshd lives in sbin


def missing_prerequisites() -> str:
    if os.geteuid() != 0:
        return "needs root: sshd -i must read its host key and log in as this user"
    tools = [t for t in ("sshd", "ssh", "ssh-keygen", "rsync") if not _which(t)]
    return f"missing {', '.join(tools)} (Debian: apt-get install openssh-server rsync)" if tools else ""


class Run:
    """One launcher run: its temp dir, keys, sshd config and the cluster file Ray is given."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:10]
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvpool-rayup-{self.id}-"))
        self.home = self.dir / "home"
        self.name = f"kvpool-test-{self.id}"
        self.ray_port, self.etcd_port = free_port(HEAD), free_port(HEAD)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",  # kvpool put/get/down here, with the token made for this run
            "RAY_AUTH_TOKEN_PATH": str(self.dir / "auth_token"),
            "RAY_USAGE_STATS_ENABLED": "0",
            MARK: self.id,
            "RAY_UP_enable_autoscaler_v2": "0",
        }
        self.bin = Path(sys.prefix) / "bin"

    @property
    def ray_address(self) -> str:
        return f"{HEAD}:{self.ray_port}"

    @property
    def etcd(self) -> str:
        return f"{HEAD}:{self.etcd_port}"

    def prepare(self) -> Path:
        self.home.mkdir()
        self.kvpool("ray-token", "--path", self.env["RAY_AUTH_TOKEN_PATH"])  # as cluster.yaml asks, before `ray up`
        (self.home / ".bashrc").touch()  # Ray's commands start with `source ~/.bashrc`
        # Login shells reset PATH in /etc/profile; the "machine's" profile puts its ssh client first.
        (self.home / ".bash_profile").write_text(f"export PATH={self.dir / 'bin'}:$PATH\n")
        (self.home / "kvpool-venv").symlink_to(sys.prefix)
        for key in ("client_key", "host_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.dir / key], check=True)
        (self.dir / "authorized_keys").write_text((self.dir / "client_key.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        (self.dir / "sshd_config").write_text(
            f"HostKey {self.dir / 'host_key'}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
            "StrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPidFile none\nLogLevel ERROR\n"
        )
        sshd = _which("sshd")
        bin_dir = self.dir / "bin"
        env = f"HOME={self.home} KVPOOL_NODE_IP=%h {MARK}={self.id} RAY_USAGE_STATS_ENABLED=0"
        proxy = f"{sshd} -i -f {self.dir / 'sshd_config'} -o 'SetEnv={env}'"
        # Ray hands the head a config without the proxy command (a real head reaches its workers on port
        # 22), and ssh expands `~` in -i with the passwd home, not $HOME: the "machines'" own ssh client
        # is configured with both, as a real machine's ~/.ssh/config would be.
        (self.dir / "ssh_config").write_text(
            f"Host *\n  ProxyCommand {proxy}\n  IdentityFile {self.dir / 'client_key'}\n"
        )
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {self.dir / "ssh_config"} "$@"\n')
        (bin_dir / "ssh").chmod(0o755)
        return self._cluster_file(proxy)

    def _cluster_file(self, proxy: str) -> Path:
        text = (ROOT / "cluster.yaml").read_text()
        text = (
            text.replace("127.0.0.2", HEAD).replace(":6379", f":{self.ray_port}").replace("=6379", f"={self.ray_port}")
        )
        text = text.replace("2379", str(self.etcd_port))
        text = text.replace(
            '"kvpool_dram_mib": 16384, "kvpool_nvme_mib": 131072', '"kvpool_dram_mib": 64, "kvpool_nvme_mib": 128'
        )
        config = yaml.safe_load(text)
        config["cluster_name"] = self.name
        config["provider"]["worker_ips"] = [WORKER]
        config["auth"] = {
            "ssh_user": "root",
            "ssh_private_key": str(self.dir / "client_key"),
            "ssh_proxy_command": proxy,
        }
        # The token, made here as `kvpool ray-token` makes it, shipped to each "machine's" ~/.ray as cluster.yaml says.
        assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
        config["file_mounts"] = {"~/.ray/auth_token": self.env["RAY_AUTH_TOKEN_PATH"]}
        # The venv of this checkout stands in for the install (same machine); check it works on the node.
        config["setup_commands"] = ["~/kvpool-venv/bin/kvpool --help > /dev/null"]
        small = "--num-cpus=1 --object-store-memory=100000000"
        config["head_start_ray_commands"][1] += f" {small} --include-dashboard=false --dashboard-agent-listen-port=0"
        config["worker_start_ray_commands"][0] += f" {small} --dashboard-agent-listen-port=0"
        path = self.dir / "cluster.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def run(self, *args: object, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(a) for a in args]
        log("$ " + shlex.join(cmd))
        done = subprocess.run(cmd, env=self.env, text=True, capture_output=True, timeout=timeout, cwd=self.dir)
        output = (done.stdout + done.stderr).strip()
        if output:
            print(
                "\n".join("    " + line for line in output.splitlines()[-int(os.environ.get("RAY_UP_LINES", "40")) :]),
                flush=True,
            )
        if check and done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} {cmd[1]} exited with {done.returncode}")
        return done

    def kvpool(self, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.run(self.bin / "kvpool", *args, timeout=timeout)

    def wait_for_pool(self, nodes: int, timeout: float) -> None:
        """Until ``nodes`` PoolNodes are registered in etcd (the worker joins after the autoscaler starts it)."""
        from kvpool.metadata.client import EtcdClient
        from kvpool.metadata.namespace import Namespace

        deadline = time.monotonic() + timeout
        seen = -1
        client = EtcdClient(MetadataConfig(endpoints=(self.etcd,), cluster="default"))
        try:
            while True:
                count = len(client.get_prefix(Namespace("default").nodes))
                if count != seen:
                    log(f"{count} of {nodes} pool nodes registered")
                    seen = count
                if count >= nodes:
                    return
                if time.monotonic() > deadline:
                    log("the autoscaler's errors (it sets the worker up over ssh):\n" + self.autoscaler_errors())
                    raise RuntimeError(f"only {count} of {nodes} pool nodes within {timeout:.0f} s")
                time.sleep(2)
        finally:
            client.close()

    def autoscaler_errors(self, lines: int = 20) -> str:
        for log_file in Path(tempfile.gettempdir(), "ray").glob("session_*/logs/monitor.log"):
            if self.name in log_file.read_text(errors="replace"):
                err = log_file.with_suffix(".err").read_text(errors="replace").splitlines()
                return "\n".join("    " + line for line in err[-lines:])
        return "    (no autoscaler log of this cluster found)"

    def teardown(self) -> None:
        try:
            self.kvpool("down", "--ray-address", self.ray_address, timeout=120)
        except Exception as exc:  # still kill what is left
            log(f"kvpool down failed: {exc}")
        mine = [p for p in psutil.process_iter() if _marked(p, self.id)]
        log(f"stopping {len(mine)} processes started by this run (never `ray stop`)")
        for p in mine:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # ended meanwhile
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(mine, timeout=15)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # ended meanwhile
                p.kill()
        for suffix in ("state", "lock"):
            Path(tempfile.gettempdir(), "ray", f"cluster-{self.name}.{suffix}").unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _marked(p: psutil.Process, run_id: str) -> bool:
    if p.pid == os.getpid():
        return False
    try:
        return p.environ().get(MARK) == run_id
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="Leave the cluster running (stop it with Ctrl-C).")
    parser.add_argument("--timeout", type=float, default=300, help="Seconds for the cluster to come up.")
    args = parser.parse_args()
    why = missing_prerequisites()
    if why:
        log(f"cannot run here: {why}")
        return SKIP
    run = Run()
    started = time.monotonic()
    try:
        cluster = run.prepare()
        log(f"cluster file {cluster}: head {HEAD}:{run.ray_port}, worker {WORKER}, etcd {run.etcd}")
        run.run(run.bin / "ray", "up", "-y", "--no-config-cache", cluster, timeout=args.timeout)
        log(f"ray up returned after {time.monotonic() - started:.0f} s; waiting for the worker to join")
        run.wait_for_pool(2, timeout=max(60.0, args.timeout - (time.monotonic() - started)))
        data = os.urandom(3 << 20)
        src, back = run.dir / "payload.bin", run.dir / "back.bin"
        src.write_bytes(data)
        put = run.kvpool("put", src, "--replicas", "2", "--ray-address", run.ray_address, "--etcd", run.etcd)
        key = re.search(r"\b[0-9a-f]{64}\b", put.stdout)
        if key is None:
            raise RuntimeError("kvpool put did not print the chunk key")
        run.kvpool("get", key[0], "--out", back, "--ray-address", run.ray_address, "--etcd", run.etcd)
        if back.read_bytes() != data:
            raise RuntimeError("kvpool get returned bytes that differ from what kvpool put stored")
        status = run.run(
            run.bin / "ray",
            "exec",
            cluster,
            f"COLUMNS=200 ~/kvpool-venv/bin/kvpool status --etcd {run.etcd}",
            timeout=120,
        )
        holders = re.findall(r"\b([0-9a-f]{12}) \(dram\)", put.stdout)
        if len(holders) != 2 or not all(h[:8] in status.stdout for h in holders):  # the compact view shows 8
            raise RuntimeError(f"kvpool status on the head does not show both nodes holding the chunk ({holders})")
        if "ray authentication: token" not in status.stdout:
            raise RuntimeError(
                "kvpool status on the head does not show the nodes' Ray running with token authentication"
            )
        log(f"PASSED in {time.monotonic() - started:.0f} s: ray up, 2 pool nodes, 3 MiB put x2 replicas and read back")
        if args.keep:
            log(f"kept: kvpool status --etcd {run.etcd}; Ctrl-C stops it")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0
    finally:
        run.teardown()


if __name__ == "__main__":
    sys.exit(main())
