"""``kvpool status`` rendered in-process from a hand-built snapshot: compact at 80 columns, ``--wide``, ``--json``."""

import json
from contextlib import nullcontext

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvpool.cli import app, connect, root, status
from kvpool.cli.figures import short_duration, short_size
from kvpool.cli.status import NodeStatus, PoolStatus, RemoteTier, TierUse

MiB, GiB = 2**20, 2**30
runner = CliRunner()


def node(i: int, **changes: object) -> NodeStatus:
    fields: dict[str, object] = dict(
        node_id=f"{i:02d}c0ffee7d0d0d0d0d0d0d0d0d0d0d0",
        host=f"127.0.0.{2 + i}",
        pid=40_000 + i,
        dram=TierUse(12 * MiB + i, 256 * MiB),
        nvme=TierUse(0, 1024 * MiB),
        replicas=21,
        up_s=4000.0,
        metrics=f"127.0.0.1:{9100 + i}",
        watermarks=(0.6, 0.8),
        puts=37,
        gets=1234,
        moves=5,
        lookup_hits=78,
        lookups=100,
    )
    return NodeStatus(**{**fields, **changes})  # type: ignore[arg-type]


def snapshot(nodes: tuple[NodeStatus, ...], remote: RemoteTier = RemoteTier(0, 0, 0, ())) -> PoolStatus:
    return PoolStatus(
        cluster="default",
        endpoints=("127.0.0.1:23791",),
        revision=812,
        nodes=nodes,
        chunks=56,
        replicas=63,
        malformed=0,
        remote=remote,
    )


def text(renderable: object, width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_default_fits_80_columns_without_cutting_a_cell() -> None:
    nodes = (
        node(0),
        node(1, host="node-with-a-long-name.cluster.example", dram=TierUse(3 * GiB // 2, 4 * GiB), up_s=None),
        node(2, nvme=TierUse(0, 0), lookups=0, lookup_hits=0, metrics="", watermarks=None, puts=None),
    )
    out = text(status.render(snapshot(nodes)), 80)
    assert max(len(line) for line in out.splitlines()) <= 80
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("00c0", "01c0", "02c0"))]
    assert rows[0] == ["00c0ffee", "127.0.0.2", "12M/256M", "0B/1.0G", "21", "78%", "66m"]
    # a host too long for the rest folds onto a second line; every other cell stays whole
    assert rows[1][:1] + rows[1][2:] == ["01c0ffee", "1.5G/4.0G", "0B/1.0G", "21", "78%", "?"]
    lines = out.splitlines()
    folded = lines[next(i for i, line in enumerate(lines) if line.startswith("01c0")) + 1].strip()
    assert rows[1][1] + folded == "node-with-a-long-name.cluster.example"
    assert rows[2] == ["02c0ffee", "127.0.0.4", "12M/256M", "-", "21", "-", "66m"]
    assert "chunks: 56   replicas: 63   malformed records skipped: 0" in out


def test_wide_shows_every_column() -> None:
    nodes = (node(0), node(1, nvme=TierUse(0, 0), metrics="", watermarks=None, puts=None, gets=None, moves=None))
    out = text(status.render(snapshot(nodes), wide=True), 220)
    for col in status.WIDE_COLUMNS:
        assert col in out
    first, second = (line for line in out.splitlines() if "c0ffee7d0d" in line)
    cells = [c.strip() for c in first.split("│")[1:-1]]
    assert cells == [
        "00c0ffee7d0d",
        "127.0.0.2",
        "40000",
        "12.0 MiB / 256.0 MiB",
        "0.0 MiB / 1.00 GiB",
        "60%-80%",
        "21",
        "37",
        "1234",
        "5",
        "78% of 100",
        "4000 s",
        "127.0.0.1:9100",
    ]
    assert "no segment" in second and "60%-80%" not in second


def test_no_nodes_and_the_remote_tier_line() -> None:
    remote = RemoteTier(chunks=3, stored=3 * MiB, chunk_bytes=12 * MiB, codecs=("int4+zstd", "raw"))
    out = text(status.render(snapshot((), remote)), 80)
    assert "(no live nodes)" in out
    assert "remote tier: 3 chunks, 3.0 MiB stored (12.0 MiB of KV; int4+zstd, raw)" in out


def test_json_holds_the_whole_snapshot() -> None:
    data = json.loads(status.to_json(snapshot((node(0),))))
    assert data["revision"] == 812 and data["endpoints"] == ["127.0.0.1:23791"]
    (n,) = data["nodes"]
    assert n["dram"] == {"held": 12 * MiB, "capacity": 256 * MiB} and n["watermarks"] == [0.6, 0.8]
    assert n["lookup_hits"] == 78 and n["metrics"] == "127.0.0.1:9100"


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvpool status`` against a snapshot instead of etcd, on an 80-column console."""
    monkeypatch.setattr(connect, "running_cache", lambda *args: nullcontext(None))
    monkeypatch.setattr(status, "gather", lambda cache: snapshot((node(0), node(1))))
    monkeypatch.setattr(root, "console", Console(width=80, color_system=None))


@pytest.mark.usefixtures("fake_pool")
@pytest.mark.parametrize("flags", [[], ["--wide"], ["--json"]])
def test_the_command_prints_each_view(flags: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if flags == ["--wide"]:
        monkeypatch.setattr(root, "console", Console(width=250, color_system=None))
    result = runner.invoke(app, ["status", "--etcd", "127.0.0.1:2379", *flags])
    assert result.exit_code == 0, result.output
    if flags == ["--json"]:
        assert [n["host"] for n in json.loads(result.stdout)["nodes"]] == ["127.0.0.2", "127.0.0.3"]
    elif flags == ["--wide"]:
        assert "pid" in result.stdout and "watermarks" in result.stdout
    else:
        assert "pid" not in result.stdout and "12M/256M" in result.stdout
        assert all(len(line) <= 80 for line in result.stdout.splitlines())


def test_without_an_etcd_the_error_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_ETCD_ENDPOINTS", raising=False)
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        "error (ConfigError): status needs the pool's etcd: pass --etcd host:port or set KVPOOL_ETCD_ENDPOINTS"
    )


@pytest.mark.parametrize(
    ("n", "shown"), [(0, "0B"), (512 * 1024, "512K"), (64 * MiB, "64M"), (3 * GiB // 2, "1.5G"), (1000 * MiB, "1.0G")]
)
def test_short_size(n: int, shown: str) -> None:
    assert short_size(n) == shown


@pytest.mark.parametrize(("s", "shown"), [(0.4, "0s"), (119, "119s"), (4000, "66m"), (7200, "2h"), (3 * 86400, "3d")])
def test_short_duration(s: float, shown: str) -> None:
    assert short_duration(s) == shown


def test_a_tenants_use_against_its_quota_from_the_nodes_metrics() -> None:
    """``kvpool status --tenant``: what the node's metrics say the tenant holds per tier, against its quota."""
    from kvpool.pool.scrape import summed

    exposition = (
        "# TYPE kvpool_tenant_used_bytes gauge\n"
        'kvpool_tenant_used_bytes{node="n",tenant="acme",tier="dram"} 3145728.0\n'
        'kvpool_tenant_used_bytes{node="n",tenant="acme",tier="nvme"} 1048576.0\n'
        'kvpool_tenant_used_bytes{node="n",tenant="",tier="dram"} 5.0\n'
        "# TYPE kvpool_tenant_quota_bytes gauge\n"
        'kvpool_tenant_quota_bytes{node="n",tenant="acme",tier="dram"} 4194304.0\n'
        'kvpool_tenant_quota_bytes{node="n",tenant="acme",tier="nvme"} 0.0\n'
    )
    m = summed(exposition)
    assert m["kvpool_tenant_used_bytes{acme,dram}"] == 3 * MiB
    parsed = status._node(_FakeCache(), _FakeRecord(), m, 0.0).tenants  # type: ignore[arg-type]
    assert parsed["acme"] == {"dram": (3 * MiB, 4 * MiB), "nvme": (MiB, 0)} and parsed[""] == {"dram": (5, 0)}
    shown = text(status.tenant_table(snapshot((node(0, tenants=parsed), node(1))), "acme"), 120)
    assert "3.0 MiB / 4.0 MiB" in shown and "1.0 MiB / no quota" in shown and "0.0 MiB / no quota" in shown


class _FakeCache:
    def bytes_held(self, node_id: str, tier: object) -> int:
        return 0

    def replica_count(self, node_id: str | None = None) -> int:
        return 0


class _FakeRecord:
    node_id, host, pid, started, metrics = "n" * 16, "h", 1, 0.0, ""

    def capacity(self, tier: object) -> int:
        return 0


@pytest.mark.usefixtures("fake_pool")
def test_the_command_shows_one_tenant() -> None:
    result = runner.invoke(app, ["status", "--etcd", "127.0.0.1:2379", "--tenant", "acme"])
    assert result.exit_code == 0, result.output
    assert "tenant 'acme'" in result.stdout and "holds nothing on the live nodes" in result.stdout


def test_the_nodes_ray_authentication_is_shown_and_an_open_node_is_named() -> None:
    out = text(status.render(snapshot((node(0, ray_auth="token"), node(1, ray_auth="token")))), 80)
    assert "ray authentication: token" in out and "warning" not in out
    out = text(status.render(snapshot((node(0, ray_auth="token"), node(1, ray_auth="disabled")))), 200)
    assert "warning: Ray authentication is DISABLED on 127.0.0.3:" in out
    assert "unknown (no metrics)" in text(status.render(snapshot((node(0),))), 80)
    assert json.loads(status.to_json(snapshot((node(0, ray_auth="token"),))))["nodes"][0]["ray_auth"] == "token"


def test_transfer_faults_from_the_nodes_metrics_are_named_and_none_says_nothing() -> None:
    """A node whose clients' transfers went wrong (kvpool_transfer_faults_total{kind}) is named with the kinds that
    happened; a pool where none did prints no line."""
    from kvpool.pool.scrape import summed

    exposition = (
        "# TYPE kvpool_transfer_faults counter\n"
        'kvpool_transfer_faults_total{kind="read_failed",node="n"} 3.0\n'
        'kvpool_transfer_faults_total{kind="late",node="n"} 1.0\n'
        'kvpool_transfer_faults_total{kind="write_failed",node="n"} 0.0\n'
    )
    parsed = status._node(_FakeCache(), _FakeRecord(), summed(exposition), 0.0).faults  # type: ignore[arg-type]
    assert parsed == {"read_failed": 3, "late": 1}
    out = text(status.render(snapshot((node(0, faults=parsed), node(1)))), 120)
    assert "transfer faults (kvpool_transfer_faults_total): 00c0ffee 3 read_failed, 1 late" in out
    assert "transfer faults" not in text(status.render(snapshot((node(0),))), 80)
    assert json.loads(status.to_json(snapshot((node(0, faults=parsed),))))["nodes"][0]["faults"]["late"] == 1
