"""A client started with ``KVPOOL_ACCESS_LOG`` logs its lookups whole, in chain order, with its node (held chunks
with their size, missing ones with 0) and the advisor reads them back; a bad setting is a ``ConfigError`` naming
the variable."""

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvpool.cli import app
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.errors import ConfigError, SetupError
from kvpool.pool.advisor import ACCESS_LOG_ENV, ACCESS_RATE_ENV, read_access_logs
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig

KEYS = chunk_keys(CacheIdentity(model="access-log", kv_dtype="u8", layout="b", chunk_size=1), range(6))


def test_a_client_logs_its_lookups_for_the_advisor(
    pool: PoolConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ACCESS_LOG_ENV, str(tmp_path))
    monkeypatch.setenv(ACCESS_RATE_ENV, "1.0")
    with PoolClient(pool) as client:
        client.put_batch([(k, np.zeros(8192, dtype=np.uint8)) for k in KEYS[:4]])
        assert client.lookup_prefix(KEYS) == 4
        nodes, here = len(client.cache.nodes()), client.node_id
    [log] = tmp_path.glob("access-*.jsonl")
    sample = read_access_logs([str(log)])
    assert (sample.rate, sample.total, sample.nodes) == (1.0, 6, (here,))  # the node its puts land on
    [(node, items)] = sample.lookups  # one lookup, its keys in chain order
    assert node == here and [k for k, _ in items] == KEYS
    assert [s for _, s in items] == [8192] * 6  # the two not held take the size seen

    out = CliRunner().invoke(
        app,
        [
            "advise",
            str(log),
            "--etcd",
            pool.metadata.endpoints[0],
            "--cluster",
            pool.metadata.cluster,
            "--png",
            str(tmp_path / "mrc.png"),
        ],
        env={"COLUMNS": "200"},
    )
    assert out.exit_code == 0, out.output
    assert f"{nodes * pool.dram_bytes / 2**30:g} GiB" in out.output  # the live pool's DRAM, all nodes together
    assert f"{nodes * pool.nvme_bytes / 2**30:g} GiB" in out.output

    monkeypatch.setenv(ACCESS_RATE_ENV, "often")
    with pytest.raises(ConfigError, match=ACCESS_RATE_ENV):
        PoolClient(pool)
    monkeypatch.setenv(ACCESS_RATE_ENV, "0.5")
    monkeypatch.setenv(ACCESS_LOG_ENV, str(tmp_path / "missing"))
    with pytest.raises(SetupError, match=ACCESS_LOG_ENV):
        PoolClient(pool)
