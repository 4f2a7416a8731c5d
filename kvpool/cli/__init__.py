"""The ``kvpool`` command line.

``kvpool up`` brings a local pool up on the embedded default (an etcd it starts itself) and prints its
status; ``kvpool status`` shows any running pool.  Errors print one line and exit 1; ``--debug`` shows the
traceback.  One module per group of commands: :mod:`~kvpool.cli.up`, :mod:`~kvpool.cli.nodes` (join,
down), :mod:`~kvpool.cli.status`, :mod:`~kvpool.cli.chunks` (ls, put, get), :mod:`~kvpool.cli.events`, :mod:`~kvpool.cli.explain`, :mod:`~kvpool.cli.bench`,
:mod:`~kvpool.cli.plan`, :mod:`~kvpool.cli.advise`, :mod:`~kvpool.cli.gc`, :mod:`~kvpool.cli.servers` (etcd, s3),
:mod:`~kvpool.cli.keys` (keys new), :mod:`~kvpool.cli.tenants` (tenants new-secret, check) and
:mod:`~kvpool.cli.vllm` (vllm-config), :mod:`~kvpool.cli.sglang` (sglang-config), :mod:`~kvpool.cli.route` (route); the app, consoles and error translation are in :mod:`~kvpool.cli.root`,
the shared options in :mod:`~kvpool.cli.options`.
"""

# Importing a module registers its commands, in this order in --help.
# isort: off
from kvpool.cli import up, nodes, status, chunks, events, explain, vllm, sglang, bench, plan  # noqa: F401
from kvpool.cli import advise, gc, servers, keys, tenants, route  # noqa: F401
from kvpool.cli.root import app

# isort: on

__all__ = ["app", "main"]


def main() -> None:
    app()
