"""``kvpool plan``: the break-even table of the design's reference analysis, and overrides of its figures."""

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvpool import cli
from kvpool.cli import root

runner = CliRunner()
X = "\N{MULTIPLICATION SIGN}"


@pytest.fixture(autouse=True)
def wide_consoles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide terminal, so no line wraps (the consoles write to whatever sys.stdout/err are at print time)."""
    monkeypatch.setattr(root, "console", Console(width=160))
    monkeypatch.setattr(root, "err_console", Console(stderr=True, width=160))


def rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows by tier: the cells between the box-drawing bars."""
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] in ("dram", "nvme", "remote"):
            out[cells[0]] = cells[1:]
    return out


def test_reference_analysis_table() -> None:
    """Llama-3-70B, 32,768 tokens, 400 TFLOPS: the figures the issue quotes."""
    result = runner.invoke(cli.app, ["plan"])
    assert result.exit_code == 0, result.output
    assert "llama-3-70b, 32,768 tokens, KV 327,680 B/token" in result.stdout
    assert "reference analysis: 400 TFLOPS" in result.stdout
    assert "prefill   11.47 s for 4.59 PFLOP (without attention)" in result.stdout
    assert rows(result.stdout) == {
        # bandwidth GB/s, KV size GB, reload s, prefill s, speedup, verdict
        "dram": ["64", "10.74", "0.168", "11.47", f"68.4{X}", "reload"],
        "nvme": ["14", "10.74", "0.767", "11.47", f"15.0{X}", "reload"],
        "remote": ["2", "10.74", "5.37", "11.47", f"2.1{X}", "reload"],
    }


def test_fits_a_default_80_column_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(root, "console", Console(width=80))
    result = runner.invoke(cli.app, ["plan", "smollm2-135m", "--tokens", "8192", "--attention"])
    assert result.exit_code == 0, result.output
    assert all(len(line) <= 80 for line in result.stdout.splitlines())
    assert [r[-1] for r in rows(result.stdout).values()] == ["reload", "recompute", "recompute"]


def test_overrides_change_the_numbers() -> None:
    result = runner.invoke(
        cli.app, ["plan", "llama-3-70b", "--tokens", "16384", "--tflops", "200", "--nvme-gbps", "7", "--attention"]
    )
    assert result.exit_code == 0, result.output
    assert "overridden: 200 TFLOPS" in result.stdout and "(with attention)" in result.stdout
    table = rows(result.stdout)
    # 2·70e9·16384 + 4·80·64·128·(16384·16385/2) FLOP at 200 TFLOPS = 11.47 + 1.76 s; 5.37 GB of KV
    assert table["nvme"][:4] == ["7", "5.37", "0.767", "13.23"]
    assert table["dram"][:3] == ["64", "5.37", "0.0839"]  # the other tiers keep the reference figures
    assert table["remote"][:3] == ["2", "5.37", "2.68"]


def test_other_models() -> None:
    result = runner.invoke(cli.app, ["plan", "llama-3-8b", "--tokens", "1000"])
    assert result.exit_code == 0, result.output
    assert "llama-3-8b, 1,000 tokens, KV 131,072 B/token" in result.stdout
    assert rows(result.stdout)["dram"][1] == "0.131"  # 131,072,000 B


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "gpt-9"], "model must be one of llama-3-70b, llama-3-8b or smollm2-135m, got str 'gpt-9'"),
        (["plan", "--dram-gbps", "0"], "--dram-gbps must be a number > 0, got float 0.0 (expected `float` > 0.0)"),
        (["plan", "--tflops", "-5"], "--tflops must be a number > 0, got float -5.0 (expected `float` > 0.0)"),
    ],
)
def test_errors_are_one_line_with_exit_code_1(args: list[str], message: str) -> None:
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.strip() == f"error (ConfigError): {message}"


def test_help_explains_every_option() -> None:
    result = runner.invoke(cli.app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in ("--tokens", "--tflops", "--dram-gbps", "--nvme-gbps", "--remote-gbps", "--attention"):
        assert option in result.stdout
    assert "Default: 400 (reference analysis)" in result.stdout
