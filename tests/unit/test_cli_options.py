"""The command line's options: every one explained in ``--help``, and defaults read from the config classes."""

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvpool.cli import app, options
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import PoolConfig
from kvpool.pool.tiers.s3 import collect_garbage
from kvpool.pool.tiers.s3_config import GC_GRACE_S, RemoteConfig
from kvpool.prefill_decode.vllm.config import ConnectorConfig

COMMANDS = (
    "up",
    "join",
    "down",
    "status",
    "ls",
    "put",
    "get",
    "events",
    "explain",
    "vllm-config",
    "sglang-config",
    "bench",
    "plan",
    "advise",
    "gc",
    "s3",
    "etcd",
    "certs",
    "ray-token",
    "keys",
    "tenants",
    "route",
)
group: Any = typer.main.get_command(app)  # a click-style group: .commands by name, each with .params


def test_every_command_is_there() -> None:
    assert sorted(group.commands) == sorted(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_explained(name: str) -> None:
    command = group.commands[name]
    assert command.help, name
    for param in command.params:
        assert getattr(param, "help", None), f"kvpool {name} {param.name}: no help"
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "Usage" in result.stdout


def test_defaults_come_from_the_config_classes() -> None:
    assert options.CLUSTER.default == MetadataConfig().cluster
    assert options.NAMESPACE.default == PoolConfig().namespace
    assert options.NVME_CODEC.default == PoolConfig().nvme_codec
    assert options.FLUSH_AFTER.default == RemoteConfig().flush_after_s
    assert options.S3_CODEC.default == RemoteConfig().codec
    assert options.REPLICAS.default == ConnectorConfig().replicas
    defaults = {p.name: p.default for p in group.commands["gc"].params}
    assert defaults["grace"] == GC_GRACE_S == options.parameter_default(collect_garbage, "grace_s")
    vllm = {p.name: p.default for p in group.commands["vllm-config"].params}
    assert vllm["chunk_size"] == ConnectorConfig().chunk_size and vllm["ray_address"] == ConnectorConfig().ray_address


def test_field_default_refuses_what_is_not_there() -> None:
    with pytest.raises(LookupError, match="no field 'nope'"):
        options.field_default(MetadataConfig, "nope")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["join", "--ray-address", "127.0.0.2:6379"], "join needs the pool's etcd: pass --etcd"),
        (["ls", "--etcd", "not-an-endpoint"], "must be an etcd endpoint: host:port"),
        (["up", "--demo", "gpt-9"], "--demo must be one of smollm2-135m, tiny-llama or none, got str 'gpt-9'"),
        (
            ["bench", "--ttft", "12,x"],
            "--ttft[1] must be a prompt length > 0, as in 1024,4096 ('' to skip), got str 'x'",
        ),
        (["etcd", "--data-dir", "/tmp/x", "--host", "0.0.0.0"], "--host 0.0.0.0 is set but --advertise is not"),
        (["up", "--tenants", "/nonexistent/tenants.toml"], "tenants file '/nonexistent/tenants.toml' cannot be read"),
        (["up", "--engine", "sglang", "--serve", "0"], "--engine must be workers or vllm, got str 'sglang'"),
        (["up", "--engine", "vllm"], "--engine vllm is set but --serve PORT is not"),
        (["up", "--engine", "vllm", "--serve", "0", "--tenants", "t.toml"], "give --engine vllm or --tenants, not"),
        (["explain", "--model", "m"], "give PROMPT or --tokens: the prompt as a file or as token ids"),
        (["up", "--ray-auth", "off"], "--ray-auth must be token or disabled, got str 'off'"),
        (["up", "--route", "fastest"], "--route must be one of cache-aware, least-loaded, round-robin"),
        (["tenants", "check", "/nonexistent/t.toml"], "cannot be read"),
        (
            ["join", "--ray-address", "127.0.0.2:6379", "--etcd", "127.0.0.1:2379", "--nvme-dir", "/proc/kvpool"],
            "--nvme-dir /proc/kvpool cannot be created",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_ETCD_ENDPOINTS", raising=False)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_the_serving_benches_take_their_own_options() -> None:
    """``kvpool bench serve`` / ``chaos`` hand every argument, ``--help`` included, to bench/serve.py's / chaos.py's
    parser; ``--window`` runs no engine (the trace's window against the engines' caches)."""
    for name in ("serve", "chaos"):
        result = CliRunner().invoke(app, ["bench", name, "--help"])
        assert result.exit_code == 0 and f"usage: kvpool bench {name}" in result.stdout, result.output
    window = ["--window", "--sample", "100", "--requests", "60", "--engine-blocks", "32", "--speedup", "10"]
    result = CliRunner().invoke(app, ["bench", "serve", *window])
    assert result.exit_code == 0 and "layer below at most  26%" in result.stdout, result.output
    result = CliRunner().invoke(app, ["bench", "chaos", "--faults", "bogus"])
    assert result.exit_code == 2 and "name some of peer-stall" in result.output
    result = CliRunner().invoke(app, ["bench", "chaos", "--warm-up", "0"])
    assert result.exit_code != 0 and "--warm-up: a number of requests >= 1" in result.output, result.output
