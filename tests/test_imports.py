"""The module graph: acyclic in both packages, with our own imports at the top of each module (an
import hidden in a function is how a cycle hides), and every module importable on its own."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import import_graph  # noqa: E402


# Our own imports inside a function, each on purpose (the graph counts them, so no cycle hides there):
# the command line imports what its commands do once their arguments pass, so a refused call never
# imports torch; the runtime package exports `load`, `Decoder` and `Result` on first use (PEP 562),
# so its light modules import without torch.
DEFERRED = {"ygg_compile.cli": 1, "ygg_runtime": 2}


@pytest.mark.parametrize("package", ["ygg_compile", "ygg_runtime"])
def test_the_import_graph_is_acyclic_with_our_imports_at_module_level(package):
    graph, _, own = import_graph.imports(package)
    assert import_graph.cycles(graph) == []
    assert {m: n for m, n in own.items() if n} == {m: n for m, n in DEFERRED.items() if m.split(".")[0] == package}


def test_the_runtime_never_imports_the_compiler():
    graph, _, _ = import_graph.imports("ygg_runtime")
    assert not any(t.startswith("ygg_compile") for deps in graph.values() for t in deps)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(graph) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_on_its_own():
    """Each module in a process where none of ours was imported before (torch and the libraries stay
    loaded between modules: only the order of our own imports is under test)."""
    names = [m for p in ("ygg_runtime", "ygg_compile") for m in import_graph.modules(p) if not m.endswith("__main__")]
    code = (
        "import importlib, sys, traceback\n"
        f"failed = []\nfor name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] in ('ygg_runtime', 'ygg_compile')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception:\n        failed.append(name + ': ' + traceback.format_exc().splitlines()[-1])\n"
        "print('\\n'.join(failed))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_every_library_we_import_is_declared():
    """Each third-party module our packages import belongs to a distribution pyproject.toml names
    (in its dependencies or an extra): none arrives only because another package pulled it in."""
    import ast
    import re
    import tomllib
    from importlib.metadata import packages_distributions

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    declared = {re.split(r"[<>=\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in specs}
    imported = set()
    for package in ("ygg_runtime", "ygg_compile"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third = imported - set(sys.stdlib_module_names) - {"ygg_runtime", "ygg_compile"}
    dists = packages_distributions()
    undeclared = {m: dists.get(m) for m in third
                  if not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & declared}
    assert undeclared == {}
