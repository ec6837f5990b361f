"""The import graph of our packages, read from the source with `ast` (nothing is imported):
which module imports which, the cycles among them, and how many imports hide inside functions.

    python tools/import_graph.py [ygg_compile]     # prints the graph, the cycles and the counts

tests/test_imports.py holds the graph to what it must be: acyclic, ygg_runtime never importing
ygg_compile or a heavy library.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("ygg_runtime", "ygg_compile", "ygg_bench")


def modules(package: str) -> dict[str, Path]:
    """Every module of `package` (subpackages included) by dotted name."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parent = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parent + ([base] if base else []))
    # `from pkg import mod` imports the module pkg.mod when there is one (the package's __init__
    # runs before any of its modules anyway); `from pkg import name` imports pkg itself
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def imports(package: str) -> tuple[dict[str, set[str]], dict[str, int], dict[str, int]]:
    """(graph, local, own): graph[m] = modules of `package` that m imports at any level; local[m] =
    how many of m's import statements sit inside a function; own[m] = how many of those import one
    of our own modules (only where tests/test_imports.py allows one, for the CLI's start; the graph
    counts them, so a cycle through one is still found; a heavy library imported where it is used
    keeps the CLI's start fast and is fine)."""
    mods = modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    local: dict[str, int] = {m: 0 for m in mods}
    own: dict[str, int] = {m: 0 for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        top = set(id(n) for n in tree.body)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(node, m, path.name == "__init__.py", set(mods))
            if id(node) not in top and not _in_type_checking(tree, node):
                local[m] += 1
                own[m] += any(t.split(".")[0] in OURS for t in targets)
            for t in targets:
                if t in mods and t != m:
                    graph[m].add(t)
    return graph, local, own


def _in_type_checking(tree: ast.Module, node: ast.AST) -> bool:
    """An import under a top-level `if TYPE_CHECKING:` is for annotations, not a hidden import."""
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            if any(n is node for n in ast.walk(stmt)):
                return True
    return False


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def order(graph: dict[str, set[str]]) -> list[str]:
    """The modules bottom-up: each after everything it imports (the graph must be acyclic)."""
    done: list[str] = []
    seen: set[str] = set()

    def visit(v: str) -> None:
        if v in seen:
            return
        seen.add(v)
        for w in sorted(graph[v]):
            visit(w)
        done.append(v)

    for v in sorted(graph):
        visit(v)
    return done


def main(argv: list[str]) -> int:
    package = argv[0] if argv else "ygg_compile"
    graph, local, own = imports(package)
    found = cycles(graph)
    names = order(graph) if not found else sorted(graph)
    for m in names:
        lines = len(modules(package)[m].read_text().splitlines())
        deps = ", ".join(d.removeprefix(package + ".") for d in sorted(graph[m])) or "-"
        print(f"{m.removeprefix(package + '.') or package:<20} {lines:>4} lines  {local[m]:>2} local imports  -> {deps}")
    print(f"{len(graph)} modules, {sum(local.values())} function-local imports ({sum(own.values())} of our own modules), "
          + (f"{len(found)} cycle(s): " + "; ".join(" <-> ".join(c) for c in found) if found else "acyclic"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
