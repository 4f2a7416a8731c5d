"""The root of the ``kvpool`` command line: the Typer app, its two consoles, ``--debug`` and the translation
of kvpool errors into one line and exit code 1.

Commands print through :data:`console` and :data:`err_console` of this module (looked up at print time, so
tests can swap them for a console of a known width).
"""

import logging
import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from kvpool.errors import KvPoolError

app = typer.Typer(
    help="kvpool: a distributed memory pool that keeps LLM KV caches alive outside GPU memory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs.")) -> None:
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@contextmanager
def errors() -> Iterator[None]:
    """One clear line and exit code 1 for every kvpool error; the traceback only with --debug."""
    try:
        yield
    except KvPoolError as exc:
        if _state["debug"]:
            raise
        err_console.print(f"[bold red]error[/] ({type(exc).__name__}): {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """``kill`` (SIGTERM) stops a foreground command the way Ctrl-C does: as a ``KeyboardInterrupt``."""
    signal.signal(signal.SIGTERM, _interrupt)


def wait_for_interrupt(what: str) -> None:
    """Block until Ctrl-C or SIGTERM, then say that ``what`` is stopping."""
    stop_on_sigterm()
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        console.print(f"stopping {what}")


class ConsoleReport:
    """A ``kvpool.stack.Report`` on the console: a spinner while a step runs, one line per outcome."""

    def busy(self, what: str) -> AbstractContextManager[object]:
        return console.status(what)

    def done(self, line: str) -> None:
        console.print(line)
