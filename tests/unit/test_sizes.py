"""Sizes issue #28 set for the installed package: no module over 400 lines, no function over 60 (its ``def`` line to its
last, decorators, docstring and nested functions included).  A file or function that grows past them is split where
it does two things, not given an exception here."""

import ast

from test_import_graph import installed_modules

MODULE_LINES = 400
FUNCTION_LINES = 60


def test_no_module_over_400_lines_and_no_function_over_60() -> None:
    too_long: list[str] = []
    for name, path in sorted(installed_modules().items()):
        text = path.read_text()
        if (lines := len(text.splitlines())) > MODULE_LINES:
            too_long.append(f"{name}: {lines} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (lines := (node.end_lineno or node.lineno) - start + 1) > FUNCTION_LINES:
                    too_long.append(
                        f"{name}.{node.name} (line {node.lineno}): {lines} lines (at most {FUNCTION_LINES})"
                    )
    assert not too_long, "\n".join(too_long)
