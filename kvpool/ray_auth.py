"""Ray's token authentication, wherever kvpool starts a Ray cluster or attaches to one.

A pool is a Ray cluster, and Ray's control plane runs whatever code a caller submits; with token authentication on
(``RAY_AUTH_MODE=token``) every Ray process, driver and worker must present the cluster's shared token.  kvpool turns
it on wherever it starts Ray (:class:`~kvpool.servers.ray_cluster.LocalRayCluster`: a token generated per cluster,
in a file only its owner can read) and looks for the token where Ray does before attaching to a cluster
(:func:`prepare_attach`): ``RAY_AUTH_TOKEN`` (the token itself), else the file ``RAY_AUTH_TOKEN_PATH`` names, else
``~/.ray/auth_token``.  Only a user's own ``RAY_AUTH_MODE=disabled`` (or ``kvpool up --ray-auth disabled``) turns it
off.  What it protects and what it does not: docs/security.md.
"""

import logging
import os
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from msgspec import Meta

from kvpool.core.config import validated
from kvpool.errors import ConfigError, KvPoolError, RayAuthError

Mode = Annotated[Literal["token", "disabled"], Meta(description="token or disabled")]
MODES: tuple[str, ...] = get_args(get_args(Mode)[0])
MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE = "auth_token"  #: the name of a token file kvpool writes


def default_token_path() -> Path:
    """Where Ray looks last, and where ``ray get-auth-token --generate`` and ``kvpool ray-token`` write."""
    return Path.home() / ".ray" / TOKEN_FILE


@dataclass(frozen=True)
class Token:
    """Where this process's token comes from."""

    source: str  #: how a user would name it: ``RAY_AUTH_TOKEN`` or a file's path
    path: Path | None  #: the file holding it; None: the token is the ``RAY_AUTH_TOKEN`` value itself


def find_token(path: str | Path | None = None) -> Token | None:
    """The token Ray would use in this process, found where Ray looks (``RAY_AUTH_TOKEN``, then the file
    ``RAY_AUTH_TOKEN_PATH`` names, then ``~/.ray/auth_token``), or in ``path`` only when it is given; None: none.
    A named file that is missing or empty is an error, not a fallback, as it is for Ray."""
    if path is None and os.environ.get(TOKEN_ENV, "").strip():
        return Token(TOKEN_ENV, None)
    named = path if path is not None else os.environ.get(TOKEN_PATH_ENV)
    candidate = Path(named).expanduser() if named else default_token_path()
    try:
        found = bool(candidate.read_text().strip())
    except OSError as exc:
        if not named:
            return None
        raise RayAuthError(f"the Ray token file {candidate} cannot be read ({exc.strerror}): {_WHERE}") from exc
    if not found and named:
        raise RayAuthError(f"the Ray token file {candidate} is empty: {_WHERE}")
    return Token(str(candidate), candidate) if found else None


_WHERE = (
    f"put the cluster's token in ~/.ray/{TOKEN_FILE}, or name its file in {TOKEN_PATH_ENV} (kvpool up prints the "
    f"local cluster's; kvpool ray-token makes one for cluster.yaml); for a cluster that runs without authentication, "
    f"say so with {MODE_ENV}=disabled"
)


def write_token(path: str | Path) -> Path:
    """A new random token (256 bits, as Ray makes them) in ``path``, readable only by its owner; an existing file is
    replaced (rotation).  Its folder is made private (0700) if it does not exist."""
    path = Path(path).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    fresh.replace(path)  # whole or not at all: a reader never sees half a token
    return path


def requested_mode(explicit: str | None = None) -> str:
    """The mode to start a cluster in: ``explicit`` (``--ray-auth``), else the user's ``RAY_AUTH_MODE``, else token."""
    mode = (explicit or os.environ.get(MODE_ENV) or "token").lower()
    return validated(Mode, mode, "--ray-auth" if explicit else MODE_ENV)


def use(mode: str, token_path: Path | None = None) -> None:
    """Run this process (and the processes it starts from now on) in ``mode``, with the token of ``token_path``;
    Ray's cached settings and token are reloaded, so the next ``ray.init`` sees them."""
    os.environ[MODE_ENV] = mode
    if mode == "token" and token_path is not None:
        os.environ[TOKEN_PATH_ENV] = str(token_path)
        os.environ.pop(TOKEN_ENV, None)  # Ray would read it before the file
    _reload()


def restore(saved: dict[str, str | None]) -> None:
    """Put back the variables :func:`saved_env` returned and reload Ray's view of them."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _reload()


def saved_env() -> dict[str, str | None]:
    """This process's authentication variables, for :func:`restore`."""
    return {name: os.environ.get(name) for name in (MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV)}


def _reload() -> None:
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # not in its stub

    Config.initialize("")  # the mode is read into Ray's config once; read it again
    AuthenticationTokenLoader.instance().reset_cache()


def current_mode() -> str:
    """The mode this process's Ray runs in (in a pool node: the mode its Ray node was started in)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def init(**kwargs: Any) -> None:
    """``ray.init(**kwargs)`` with Python's ``random`` drawn from the OS meanwhile, and given back as it was.

    Ray names a driver's subscriptions to its control plane's error and log channels with bytes from the ``random``
    module.  An engine seeds ``random`` (vLLM with its ``--seed``, 0 by default) before its connector attaches, so
    every engine process drew the same name, and the control plane answered each one's long poll at once to take the
    other's: about a thousand polls a second per engine, measured taking half a core in each engine and more than a
    core in Ray's GCS on a 2-core host (docs/serving.md).  The engine's own random sequence is left as it was."""
    import ray

    state = random.getstate()
    random.seed()  # from os.urandom
    try:
        ray.init(**kwargs)
    finally:
        random.setstate(state)


def attach(address: str, token_path: str | Path | None = None, **kwargs: Any) -> None:
    """Attach this process to the Ray cluster at ``address`` (``ray.init`` with ``kwargs``) with its token
    (:func:`prepare_attach`), or one clear error saying why it cannot."""
    prepare_attach(address, token_path)
    try:
        init(address=address, logging_level=logging.WARNING, **kwargs)
    except (ConnectionError, RuntimeError) as exc:
        raise KvPoolError(
            f"cannot attach to the Ray cluster at {address}: is it up, and is that its head? ({exc})"
        ) from exc


def prepare_attach(address: str, token_path: str | Path | None = None) -> str:
    """Make this process ready to attach to the Ray cluster at ``address``, and check that the cluster takes its
    credentials before ``ray.init`` (which would retry a refused token for 20 s and then only say it cannot connect).

    The token comes from ``token_path``, else from where Ray looks; without one, or when the cluster refuses it,
    :class:`RayAuthError` says where to put it.  ``RAY_AUTH_MODE=disabled`` here attaches without a token (and
    fails the same way if the cluster requires one).  Returns the mode used.
    """
    mode = os.environ.get(MODE_ENV, "").lower()
    if mode:
        validated(Mode, mode, MODE_ENV)
    token = None
    if mode != "disabled":
        token = find_token(token_path)
        if token is None:
            raise RayAuthError(f"no token for the Ray cluster at {address}: {_WHERE}")
        mode = "token"
    use(mode, token.path if token is not None and token_path is not None else None)
    _probe(address, token)
    return mode


def _probe(address: str, token: Token | None) -> None:
    """One call to the cluster's GCS with this process's credentials: a refusal comes back at once."""
    from ray._private.services import canonicalize_bootstrap_address
    from ray._raylet import GcsClient  # type: ignore[attr-defined]
    from ray.exceptions import AuthenticationError, RpcError

    try:
        gcs = canonicalize_bootstrap_address(address)  # "auto": the cluster this host's Ray node belongs to
    except ValueError as exc:
        raise ConfigError(f"the Ray address must be host:port or auto, got {address!r:.60}") from exc
    if gcs is None:
        return  # no cluster found for "auto": ray.init says so
    try:
        GcsClient(address=gcs)
    except AuthenticationError as exc:
        if token is None:
            raise RayAuthError(
                f"the Ray cluster at {address} requires a token and {MODE_ENV}=disabled here: unset it and "
                f"put the cluster's token in ~/.ray/{TOKEN_FILE} or name its file in {TOKEN_PATH_ENV}"
            ) from exc
        raise RayAuthError(
            f"the Ray cluster at {address} refused the token from {token.source}: that is not its token; {_WHERE}"
        ) from exc
    except RpcError as exc:
        raise KvPoolError(
            f"cannot attach to the Ray cluster at {address}: is it up, and is that its head? ({exc})"
        ) from exc
