"""The session's Ray cluster runs with token authentication, as every cluster kvpool starts does: a process without
its token cannot reach the pool's actors (a typed error saying where to put the token), one with it can, wherever
Ray looks for it; every node reports the mode, and ``kvpool status`` shows it."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

from kvpool import ray_auth
from kvpool.cli import status
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig

#: a driver that attaches as kvpool's commands do, then calls a PoolNode actor; prints OK or the error's class
DRIVER = textwrap.dedent(
    """
    import sys, ray
    from kvpool.errors import KvPoolError
    from kvpool.pool.protocol import actor_name
    from kvpool.ray_auth import attach
    try:
        attach(sys.argv[1], namespace=sys.argv[2])
        node = ray.get_actor(actor_name(sys.argv[3]), namespace=sys.argv[2])
        print("OK", ray.get(node.stats.remote())["tiers"]["dram"]["capacity"])
    except KvPoolError as exc:
        print(f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    """
)


def drive(pool: PoolConfig, node_id: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The driver in a process whose only Ray credentials are ``env`` and what ``home`` holds."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    args = [ray.get_runtime_context().gcs_address, pool.namespace, node_id]
    return subprocess.run(
        [sys.executable, "-c", DRIVER, *args],
        env={**base, "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def token() -> Path:
    """The session cluster's token file (LocalRayCluster made it; this process found it as Ray would)."""
    found = ray_auth.find_token()
    assert found is not None and found.path is not None
    return found.path


def test_a_process_without_the_token_cannot_reach_the_pool_and_is_told_where_to_put_it(
    pool: PoolConfig, ray_cluster: list[str], token: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    none = drive(pool, ray_cluster[0], home)
    assert none.returncode == 1 and none.stdout.startswith("RayAuthError: no token for the Ray cluster"), none.stderr
    assert "~/.ray/auth_token" in none.stdout and "RAY_AUTH_TOKEN_PATH" in none.stdout

    wrong = tmp_path / "wrong"
    ray_auth.write_token(wrong)
    refused = drive(pool, ray_cluster[0], home, RAY_AUTH_TOKEN_PATH=str(wrong))
    assert refused.returncode == 1, refused.stderr
    assert (
        f"RayAuthError: the Ray cluster at {ray.get_runtime_context().gcs_address} refused the token from {wrong}"
        in (refused.stdout)
    )
    unauthenticated = drive(pool, ray_cluster[0], home, RAY_AUTH_MODE="disabled")
    assert unauthenticated.returncode == 1, unauthenticated.stderr
    assert "requires a token and RAY_AUTH_MODE=disabled here" in unauthenticated.stdout


def test_a_process_with_the_token_reaches_the_pool_from_wherever_ray_looks(
    pool: PoolConfig, ray_cluster: list[str], token: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    by_path = drive(pool, ray_cluster[0], home, RAY_AUTH_TOKEN_PATH=str(token))
    assert by_path.returncode == 0 and by_path.stdout.startswith(f"OK {pool.dram_bytes}"), (
        by_path.stdout + by_path.stderr
    )
    by_value = drive(pool, ray_cluster[0], home, RAY_AUTH_TOKEN=token.read_text())
    assert by_value.returncode == 0, by_value.stdout + by_value.stderr
    shutil.copy(token, home / ".ray" / "auth_token")  # Ray's default file
    by_default = drive(pool, ray_cluster[0], home)
    assert by_default.returncode == 0, by_default.stdout + by_default.stderr


def test_every_node_runs_with_token_authentication_and_status_says_so(client: PoolClient) -> None:
    assert ray_auth.current_mode() == "token"
    assert client.cache.wait_until(lambda c: len(c.nodes()) == 3, timeout_s=10)
    snapshot = status.gather(client.cache)
    assert [n.ray_auth for n in snapshot.nodes] == ["token"] * 3
    assert status.ray_auth_line(snapshot) == "ray authentication: token"
