"""Import circles: modules (and packages) of aerie that import each other, directly or around a ring.

    python scripts/import_circles.py             # aerie/, flows/ and deployments/
    python scripts/import_circles.py ROOT...     # these package folders (relative to the repository)

Every import counts, at module level, inside a function (a deferred import hides
a circle from the interpreter, not from a reader) or under `if TYPE_CHECKING:` (a type-only import is
a circle for the type checker and for a reader). Two graphs are checked: modules
(`aerie.extract.work` -> `aerie.extract.slices`) and packages (`aerie.extract` -> `aerie.serving`, a
top-level module such as `aerie.store` is its own package). A package's settings
module (`aerie.train.config`) is a node of its own in the package graph: `aerie.config` gathers the
settings of every stage package below it, and the stages above it read the whole. A package's
`__init__` re-exporting its own submodules is no circle: edges inside one package are left out of the
package graph, and the implicit import of a parent package by its submodules is not an edge.
Prints each circle as `a -> b -> a` and exits 1 if any, 0 otherwise.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROOTS = ("aerie", "flows", "deployments")

Graph = dict[str, set[str]]
SETTINGS = "config"  # a package's settings module


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given package folders."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it sits (type-only ones included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    anchor = parts[:keep]
    return ".".join([*anchor, node.module] if node.module else anchor)


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The known modules `module` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    targets: set[str] = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _base(module, path.name == "__init__.py", node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            # `import a.b.c` of a name that is not a module itself: its nearest known parent.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def module_graph(root: Path, packages: Iterable[str]) -> Graph:
    files = module_files(root, packages)
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


def package_of(module: str, packages: set[str]) -> str:
    """`aerie.extract.work` -> `aerie.extract`; `aerie.store` (a module at the top) and
    `aerie.extract.config` (a package's settings) -> themselves."""
    parts = module.split(".")
    if len(parts) == 3 and parts[2] == SETTINGS:
        return module
    return ".".join(parts[:2]) if len(parts) > 1 or module in packages else module


def package_graph(modules: Graph) -> Graph:
    names = set(modules)
    graph: Graph = {}
    for module, targets in modules.items():
        source = package_of(module, names)
        edges = graph.setdefault(source, set())
        for target in targets:
            other = package_of(target, names)
            if other != source and not source.startswith(other + ".") and not other.startswith(source + "."):
                edges.add(other)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components of more than one node (each a set of nodes that reach one another)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def ring(graph: Graph, component: list[str]) -> list[str]:
    """One shortest cycle through the component's first node, to print: a -> b -> a."""
    start = component[0]
    members = set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ()) & members):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return component


def circles(root: Path, packages: Iterable[str]) -> list[tuple[str, list[str], list[str]]]:
    """(graph name, component, one ring through it) for every circle among modules and packages."""
    modules = module_graph(root, packages)
    found = []
    for name, graph in (("modules", modules), ("packages", package_graph(modules))):
        found += [(name, c, ring(graph, c)) for c in strongly_connected(graph)]
    return found


def main(argv: list[str]) -> int:
    packages = argv or list(DEFAULT_ROOTS)
    found = circles(ROOT, [p for p in packages if (ROOT / p).is_dir()])
    for name, component, cycle in found:
        print(f"{name}: {' -> '.join(cycle)}  ({len(component)} in the circle: {', '.join(component)})")
    if found:
        print(f"{len(found)} import circle(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
