"""The metadata scale simulation (``bench/metadata.py --scale``) at toy size against the session's etcd: every phase
publishes what it says, every watch sees it, a new client snapshots it all, and nothing is left behind."""

from pathlib import Path

import pytest
from rich.console import Console

from kvpool.bench.metadata_scale import ScaleSettings, plot, render, run_scale
from kvpool.errors import ConfigError
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.servers.etcd import EmbeddedEtcd


def test_toy_simulation_publishes_watches_and_cleans_up(etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    settings = ScaleSettings(node_counts=(1, 2), chunks=200, caches=1, watchers=1, publisher_procs=1, watch_procs=1)
    out = run_scale(settings, etcd_server.endpoint, etcd_server.pid, None, Console(quiet=True))
    assert [p["placements"] for p in out["phases"]] == [100, 100]
    for phase in out["phases"]:
        assert set(phase["lag"]) == {"cache", "bare"}
        assert phase["placements_per_s"] > 0 and phase["raw_puts_per_s"] > 0
    assert out["client"]["chunks"] == 200
    assert out["client"]["bytes_per_chunk_traced"] > 0
    assert out["departure"]["placements"] == 100
    etcd = EtcdClient(MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=out["cluster"]))
    try:
        assert etcd.get_prefix(Namespace(out["cluster"]).root) == []
    finally:
        etcd.close()
    render(out, Console(quiet=True))
    pytest.importorskip("matplotlib")
    plot(out, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_settings_refuse_fewer_chunks_than_nodes() -> None:
    with pytest.raises(ConfigError, match="--chunks"):
        ScaleSettings(node_counts=(64,), chunks=10)
    with pytest.raises(ConfigError, match="at least one watch"):
        ScaleSettings(caches=0, watchers=0)
