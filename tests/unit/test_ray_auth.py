"""Where a process finds Ray's token (as Ray does), the token files kvpool writes, the modes it accepts.  Attaching
to a live cluster with and without the token: tests/integration/pool/test_ray_auth_live.py."""

import os
import stat
from pathlib import Path

import pytest

from kvpool import ray_auth
from kvpool.errors import ConfigError, RayAuthError
from kvpool.ray_auth import MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, Token


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No token anywhere: none of Ray's variables, and a home without ~/.ray."""
    for name in (MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_the_token_is_found_where_ray_looks_in_ray_s_order(
    clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ray_auth.find_token() is None
    default = ray_auth.write_token(clean_env / ".ray" / "auth_token")
    assert ray_auth.find_token() == Token(str(default), default)
    named = ray_auth.write_token(tmp_path / "named")
    monkeypatch.setenv(TOKEN_PATH_ENV, str(named))
    assert ray_auth.find_token() == Token(str(named), named)  # the named file before the default one
    monkeypatch.setenv(TOKEN_ENV, "abc")
    assert ray_auth.find_token() == Token(TOKEN_ENV, None)  # the variable before any file
    assert ray_auth.find_token(default) == Token(str(default), default)  # a path given: that file only


def test_a_named_token_file_that_is_missing_or_empty_is_an_error_not_a_fallback(
    clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray_auth.write_token(clean_env / ".ray" / "auth_token")
    monkeypatch.setenv(TOKEN_PATH_ENV, str(tmp_path / "missing"))
    with pytest.raises(RayAuthError, match=r"cannot be read .* RAY_AUTH_TOKEN_PATH"):
        ray_auth.find_token()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RayAuthError, match="is empty"):
        ray_auth.find_token(tmp_path / "empty")


def test_a_written_token_is_readable_only_by_its_owner_and_rotation_replaces_it(tmp_path: Path) -> None:
    path = ray_auth.write_token(tmp_path / "new" / "auth_token")
    first = path.read_text()
    assert len(first) == 64 and int(first, 16) >= 0  # 256 bits, hex, as Ray makes them
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ray_auth.write_token(path).read_text() != first
    assert sorted(os.listdir(path.parent)) == ["auth_token"]  # no temporary file left behind


def test_the_mode_to_start_in_is_token_unless_the_user_asks_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ray_auth.requested_mode() == "token"
    monkeypatch.setenv(MODE_ENV, "DISABLED")
    assert ray_auth.requested_mode() == "disabled"
    assert ray_auth.requested_mode("token") == "token"  # --ray-auth before the variable
    with pytest.raises(ConfigError, match="--ray-auth must be token or disabled, got str 'off'"):
        ray_auth.requested_mode("off")
    monkeypatch.setenv(MODE_ENV, "k8s")
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE must be token or disabled"):
        ray_auth.requested_mode()


def test_attaching_without_a_token_says_where_to_put_it_before_calling_ray() -> None:
    with pytest.raises(RayAuthError, match=r"no token for the Ray cluster at 127.0.0.9:1: put .* ~/.ray/auth_token"):
        ray_auth.prepare_attach("127.0.0.9:1")


def test_ray_init_draws_names_from_the_os_not_from_an_engines_seeded_random(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray names a driver's control-plane subscriptions with ``random``; engines seed it alike (vLLM: 0), and two
    drivers of one name take each other's long poll a thousand times a second.  What ray.init draws differs between
    two processes seeded alike, and the seeded sequence goes on after the init as if it had not run."""
    import random

    import ray

    drawn: list[int] = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: drawn.append(random.getrandbits(224)))
    after = []
    for _ in range(2):
        random.seed(0)
        ray_auth.init(address="127.0.0.2:1")
        after.append(random.random())
    random.seed(0)
    assert drawn[0] != drawn[1] and random.getrandbits(224) not in drawn
    random.seed(0)
    assert after == [random.random()] * 2
