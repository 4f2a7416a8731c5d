"""The import graph of the installed package: no two units import each other, and no files import in a circle.

A unit is the first name after ``kvpool.``: ``pool``, ``metadata``, ``cli``, ``stack``, ``bench``, ...  Files are named as
pyproject.toml installs them (``pool/node/store.py`` is ``kvpool.pool.node.store``).  Every import statement counts, wherever it
is in a file: at the top, inside a function, under ``if TYPE_CHECKING:`` or ``if __name__ == "__main__":``.  A lazy
import is still a dependency.  The graph is read from the source with ``ast``, so nothing gets imported.

Each edge keeps the statements that make it (file:line), so a failure says which imports to move.
"""

import ast
import tomllib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import networkx  # torch's own dependency

ROOT = Path(__file__).resolve().parents[2]

# Known before issue #28 and still here.  Issue #28 removes them, and nothing may be added: a new pair or circle is
# fixed by moving code, never by a new entry.  When an entry stops occurring, test_every_known_one_still_occurs
# fails until you delete it, so these sets only shrink.
#: units that import each other, each pair sorted (none left: metadata and pool share kvpool.core, issue #28)
KNOWN_TWO_WAY: set[tuple[str, str]] = set()
#: folders (packages) that import each other, beside units (none left: the GPUDirect NVMe I/O, which reads pool's
#: segments, sits beside them in pool/, and tiers/ is below pool's shared files, #28)
KNOWN_TWO_WAY_FOLDERS: set[tuple[str, str]] = set()
#: files that import each other in a circle (none left: the store owns its MoveBooks, moves.py is below both, #28)
KNOWN_CIRCLES: set[frozenset[str]] = set()


# -- the graph ------------------------------------------------------------------------------------------------------


def installed_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, by its installed name, as pyproject.toml's ``package-dir`` lays out the files."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    named: dict[Path, str] = {}
    # shallow folders first, so a deeper mapping (``kvpool.pool.tiers`` = pool/tiers) names its files last
    for package, folder in sorted(package_dir.items(), key=lambda item: len(Path(item[1]).parts)):
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            named[path] = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
    return {module: path for path, module in named.items()}


def imports_of(module: str, source: str, modules: Iterable[str], is_package: bool = False) -> Iterator[tuple[str, int]]:
    """The modules of ``modules`` that ``module`` imports, with the line of each statement.

    ``from pkg import name`` imports ``pkg.name`` when that is a module; it counts ``pkg`` itself (its
    ``__init__``) only when one of the names is not a module of its own.  A name that is not a module counts as
    the nearest module above it."""
    known = set(modules)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{alias.name}" for alias in node.names]
            if any(name not in known for name in names):
                names.append(base)
        else:
            continue
        targets = set()
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith("kvpool"):
                targets.add(name)
        yield from ((target, node.lineno) for target in sorted(targets))


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvpool"


@dataclass(frozen=True)
class Graph:
    modules: dict[str, Path]
    #: the statements of each import between two modules, as ``path:line``
    sites: dict[tuple[str, str], list[str]]

    def where(self, edges: Iterable[tuple[str, str]]) -> list[str]:
        return [f"    {site}  {a} imports {b}" for a, b in sorted(edges) for site in self.sites[a, b]]

    def two_way(self) -> dict[tuple[str, str], list[tuple[str, str]]]:
        """Each pair of units that import each other, sorted, with the imports between them (both ways)."""
        between: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
        for a, b in self.sites:
            if unit(a) != unit(b) and "kvpool" not in (unit(a), unit(b)):
                between[unit(a), unit(b)].append((a, b))
        return {(x, y): between[x, y] + between[y, x] for x, y in between if x < y and (y, x) in between}

    def folder(self, module: str) -> str:
        """The package ``module`` lies in (itself, for a package's ``__init__``)."""
        return module if self.modules[module].name == "__init__.py" else module.rpartition(".")[0]

    def two_way_folders(self) -> dict[tuple[str, str], list[tuple[str, str]]]:
        """Each pair of packages that import each other (``kvpool.pool.node`` and ``kvpool.pool.client``, or a
        package and its parent), sorted, with the imports between them; the top package ``kvpool`` (errors at the
        bottom, the CLI at the top) is the units' rule's business."""
        between: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
        for a, b in self.sites:
            fa, fb = self.folder(a), self.folder(b)
            if fa != fb and "kvpool" not in (fa, fb):
                between[fa, fb].append((a, b))
        return {(x, y): between[x, y] + between[y, x] for x, y in between if x < y and (y, x) in between}

    def circles(self) -> list[frozenset[str]]:
        """The strongly connected sets of more than one module."""
        components = networkx.strongly_connected_components(networkx.DiGraph(list(self.sites)))
        return [frozenset(c) for c in components if len(c) > 1]

    def inside(self, circle: frozenset[str]) -> list[tuple[str, str]]:
        return [(a, b) for a, b in self.sites if a in circle and b in circle]


@cache
def graph() -> Graph:
    modules = installed_modules()
    sites: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in modules.items():
        for target, line in imports_of(module, path.read_text(), modules, path.name == "__init__.py"):
            sites[module, target].append(f"{path.relative_to(ROOT)}:{line}")
    return Graph(modules, dict(sites))


def _names(circle: frozenset[str]) -> str:
    return ", ".join(sorted(circle))


# -- the rules ------------------------------------------------------------------------------------------------------


def test_no_two_units_import_each_other() -> None:
    g = graph()
    new = {pair: edges for pair, edges in g.two_way().items() if pair not in KNOWN_TWO_WAY}
    lines = []
    for (a, b), edges in sorted(new.items()):
        lines += [f"units {a} and {b} import each other:", *g.where(edges)]
    assert not new, "\n".join(
        [*lines, "Keep one direction: move what both need into the lower layer.  Do not add to KNOWN_TWO_WAY."]
    )


def test_no_two_folders_import_each_other() -> None:
    g = graph()
    new = {pair: edges for pair, edges in g.two_way_folders().items() if pair not in KNOWN_TWO_WAY_FOLDERS}
    gone = KNOWN_TWO_WAY_FOLDERS - set(g.two_way_folders())
    lines = []
    for (a, b), edges in sorted(new.items()):
        lines += [f"folders {a} and {b} import each other:", *g.where(edges)]
    assert not new, "\n".join([*lines, "Keep one direction.  Do not add to KNOWN_TWO_WAY_FOLDERS."])
    assert not gone, f"{sorted(gone)} no longer import each other: delete them from KNOWN_TWO_WAY_FOLDERS"


def test_no_files_import_in_a_circle() -> None:
    g = graph()
    # a part of a known circle is one being taken apart: test_every_known_one_still_occurs asks for the smaller entry
    new = [c for c in g.circles() if not any(c <= known for known in KNOWN_CIRCLES)]
    lines = []
    for circle in sorted(new, key=sorted):
        lines += [f"files import in a circle: {_names(circle)}", *g.where(g.inside(circle))]
    assert not new, "\n".join(
        [*lines, "Break it: move what they share into a module of its own.  Do not add to KNOWN_CIRCLES."]
    )


def test_every_known_one_still_occurs() -> None:
    """The known sets only shrink: an entry that no longer occurs is deleted (or narrowed to what is left)."""
    g = graph()
    pairs, circles = g.two_way(), g.circles()
    stale = [
        f"units {a} and {b} no longer import each other: delete {(a, b)} from KNOWN_TWO_WAY"
        for a, b in sorted(KNOWN_TWO_WAY - set(pairs))
    ]
    for known in sorted(set(KNOWN_CIRCLES) - set(circles), key=sorted):
        left = " and ".join(_names(c) for c in circles if c < known)
        what = f"only {left} still do: put that in the entry's place" if left else "delete the entry"
        stale.append(f"{_names(known)} no longer import in a circle: {what} in KNOWN_CIRCLES")
    assert not stale, "\n".join(stale)


# -- how imports are counted ----------------------------------------------------------------------------------------


def test_every_import_counts_where_it_points() -> None:
    modules = ["kvpool", "kvpool.cli", "kvpool.cli.root", "kvpool.cli.up", "kvpool.pool", "kvpool.pool.types"]
    source = """
from kvpool.cli import root, up
from kvpool.cli import app
from . import types
import kvpool.pool.types.Tier
import numpy


def lazy() -> None:
    from kvpool.cli.root import console
"""
    assert sorted(imports_of("kvpool.pool.store", source, modules)) == [
        ("kvpool.cli", 3),  # app is defined in the package, not a module of its own
        ("kvpool.cli.root", 2),
        ("kvpool.cli.root", 10),
        ("kvpool.cli.up", 2),
        ("kvpool.pool.types", 4),
        ("kvpool.pool.types", 5),
    ]
    assert list(imports_of("kvpool.pool", "from .types import Tier\n", modules, is_package=True)) == [
        ("kvpool.pool.types", 1)
    ]


def test_the_graph_is_of_the_installed_layout() -> None:
    g = graph()
    assert g.modules["kvpool.pool.node.store"] == ROOT / "pool" / "node" / "store.py"
    assert g.modules["kvpool.pool.tiers"] == ROOT / "pool" / "tiers" / "__init__.py"
    assert g.modules["kvpool.cli"] == ROOT / "kvpool" / "cli" / "__init__.py"
    assert g.modules["kvpool.bench.limits"] == ROOT / "bench" / "limits.py"
    assert ("kvpool.pool.node.store", "kvpool.pool.node.allocator") in g.sites
