"""What the installed package raises: its own errors (``kvpool.errors``, each a ``KvPoolError`` whose message says what
to do), never a plain ``ValueError`` or ``TypeError`` that a caller would have to read a traceback to place.  Two raise
sites are not a caller's to meet, and are listed: each names why."""

import ast

from test_import_graph import installed_modules

PLAIN = {"ValueError", "TypeError"}
#: module -> why its plain raise is no caller's to meet
KNOWN = {
    "kvpool.pool.node.journal": "a malformed journal record, caught in the same module (replay stops there)",
    "kvpool.core.config": "@checked put on a function with *args or **kwargs: a programming slip, met at import",
}


def test_the_package_raises_its_own_errors() -> None:
    found: list[str] = []
    for name, path in sorted(installed_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in PLAIN and name not in KNOWN:
                found.append(f"{name}:{node.lineno}: raise {raised.id}: raise a kvpool.errors class instead")
    assert not found, "\n".join(found)


def test_every_known_one_still_raises() -> None:
    """An entry of KNOWN whose raise is gone is deleted, so the list only shrinks."""
    modules = installed_modules()
    for name in KNOWN:
        tree = ast.parse(modules[name].read_text())
        assert any(
            isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and getattr(n.exc.func, "id", "") in PLAIN
            for n in ast.walk(tree)
        ), f"{name} no longer raises a plain error: delete it from KNOWN"
