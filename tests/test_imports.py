"""The module graph: acyclic in both packages, with our own imports at the top of each module (an
import hidden in a function is how a cycle hides), and every module importable on its own."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import import_graph  # noqa: E402


# Our own imports inside a function, each on purpose (the graph counts them, so no cycle hides there):
# the command line imports what its commands do once their arguments pass (`ygg run`'s, `ygg serve`'s
# and `ygg serve --ray`'s bodies in the runtime, the toolchain's commands in ygg_compile, the
# benchmarks' in ygg_bench), so a refused call never imports torch; the runtime package exports `load`, `Decoder` and `Result` on first use (PEP 562),
# so its light modules import without torch; the CUDA backend (Triton, which a CUDA build of torch
# brings and a CPU install lacks) is imported on its first use on a GPU.
DEFERRED = {"ygg_compile.cli": 1, "ygg_bench.cli": 1, "ygg_runtime": 2, "ygg_runtime.cli": 3, "ygg_runtime.backend": 1}
PACKAGES = ["ygg_runtime", "ygg_compile", "ygg_bench"]  # bottom first: each imports only those before it


@pytest.mark.parametrize("package", PACKAGES)
def test_the_import_graph_is_acyclic_with_our_imports_at_module_level(package):
    graph, _, own = import_graph.imports(package)
    assert import_graph.cycles(graph) == []
    assert {m: n for m, n in own.items() if n} == {m: n for m, n in DEFERRED.items() if m.split(".")[0] == package}


@pytest.mark.parametrize("package", PACKAGES[:2])
def test_no_package_imports_one_above_it(package):
    """The runtime never imports the toolchain or the benchmarks; the toolchain never the benchmarks."""
    above = PACKAGES[PACKAGES.index(package) + 1:]
    graph, _, _ = import_graph.imports(package)
    assert not [(m, t) for m, deps in graph.items() for t in deps if t.split(".")[0] in above]


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(graph) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_on_its_own():
    """Each module in a process where none of ours was imported before (torch and the libraries stay
    loaded between modules: only the order of our own imports is under test)."""
    names = [m for p in PACKAGES for m in import_graph.modules(p) if not m.endswith("__main__")]
    code = (
        "import importlib, sys, traceback\n"
        f"failed = []\nfor name in {names!r}:\n"
        f"    for m in [m for m in sys.modules if m.split('.')[0] in {tuple(PACKAGES)!r}]:\n"
        "        del sys.modules[m]\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception:\n        failed.append(name + ': ' + traceback.format_exc().splitlines()[-1])\n"
        "print('\\n'.join(failed))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def _third_party_imports(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - set(PACKAGES)


def _declared() -> dict[str, set[str]]:
    """pyproject.toml's distributions by section: "" for the runtime's own dependencies, else the extra."""
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    sections = {"": project["dependencies"], **project["optional-dependencies"]}
    return {name: {re.split(r"[<>=\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in specs}
            for name, specs in sections.items()}


def _distributions(module: str) -> set[str]:
    from importlib.metadata import packages_distributions

    return {d.lower().replace("_", "-") for d in packages_distributions().get(module, [module])}


# Run by another interpreter, whose venv its own requirements file declares (`make install-openvino`)
OTHER_VENVS = {"ygg_bench/openvino_child.py": "benchmarks/openvino/requirements.txt"}


def test_every_library_we_import_is_declared():
    """Each third-party module our packages import belongs to a distribution pyproject.toml names
    (in its dependencies or an extra): none arrives only because another package pulled it in. A
    module another venv runs (OpenVINO's child) imports what that venv's requirements file pins."""
    import re

    root = Path(__file__).resolve().parent.parent
    declared = set().union(*_declared().values())
    third = {m for package in PACKAGES for path in (root / package).rglob("*.py")
             if str(path.relative_to(root)) not in OTHER_VENVS for m in _third_party_imports(path)}
    assert {m: _distributions(m) for m in third if not _distributions(m) & declared} == {}
    for module, requirements in OTHER_VENVS.items():
        pinned = {re.split(r"[<>=\[; ]", line, maxsplit=1)[0].lower().replace("_", "-")
                  for line in (root / requirements).read_text().splitlines() if line.strip() and not line.startswith("#")}
        assert {m for m in _third_party_imports(root / module) if m.replace("_", "-") not in pinned} == set(), module


def test_the_runtime_imports_only_its_own_dependencies_and_the_server_its_extra():
    """What `pip install yggdrasil` installs is all ygg_runtime imports, but for the server's modules
    (`ygg_runtime.serving`), which may also import the `serve` extra (Ray Serve's the `ray` extra
    too), and the CUDA backend's, the `gpu` extra (Triton); and
    the extras the `ygg` command asks for (ygg_runtime.cli.EXTRAS) are pyproject.toml's, module for
    distribution."""
    from ygg_runtime.cli import EXTRAS

    root = Path(__file__).resolve().parent.parent
    declared = _declared()
    for path in (root / "ygg_runtime").rglob("*.py"):
        triton = path.parent.name == "backend" and (path.name.startswith("triton_") or path.name == "cuda.py")
        serving = path.parent.name == "serving"
        extra = declared["serve"] | (declared["ray"] if path.name == "ray_serve.py" else set()) if serving else set()
        allowed = declared[""] | (declared["gpu"] if triton else extra)
        outside = {m for m in _third_party_imports(path) if not _distributions(m) & allowed}
        assert outside == set(), path.name
    for extra, modules in EXTRAS.items():
        provided = set().union(*(_distributions(m) for m in modules))
        assert provided == declared[extra] - {"yggdrasil"}, extra


def test_no_backend_module_imports_the_plan_schema():
    """The backends describe their devices with `ygg_runtime.machine`, not the plan: nothing under
    ygg_runtime/backend/ reaches `ygg_runtime.schema.plan`, directly or through another module."""
    graph, _, _ = import_graph.imports("ygg_runtime")
    for start in (m for m in graph if m.startswith("ygg_runtime.backend")):
        seen, todo = set(), [start]
        while todo:
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        assert "ygg_runtime.schema.plan" not in seen, start


def layers(package: str, modules: set[str]) -> list[set[str]]:
    """docs/design.md's layer table of `package`, bottom first: each layer's modules, dotted in full
    (a `folder/` entry stands for every module in it)."""
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    table = next(part for part in text.split(f"### {package}\n", 1)[1].strip().split("\n\n") if part.startswith("|"))
    rows = [line.split("|")[2] for line in table.splitlines()[2:] if line.startswith("|")]
    out = []
    for row in rows:
        layer = set()
        for name, folder in re.findall(r"`([\w.]+)(/?)`", row):
            full = package if name == package else f"{package}.{name}"
            layer |= {m for m in modules if m == full or m.startswith(full + ".")} if folder else {full}
        out.append(layer)
    return out


def folder(module: str) -> str:
    """A module's folder under its package (a module at the package's top is a folder of its own)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def folder_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of the graph between folders: each as the folders around it, in order."""
    edges: dict[str, set[str]] = {}
    for m, deps in graph.items():
        edges.setdefault(folder(m), set()).update(folder(d) for d in deps if folder(d) != folder(m))
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


@pytest.mark.parametrize("package", PACKAGES)
def test_the_folders_import_each_other_without_a_cycle(package):
    graph, _, _ = import_graph.imports(package)
    assert folder_cycles(graph) == []


def test_a_folder_importing_a_folder_that_imports_it_back_is_found():
    planted = {"p.model.runner": {"p.schema.params", "p.artifact.params"}, "p.artifact.load": {"p.model.runner"},
               "p.artifact.params": set(), "p.schema.params": set()}
    assert folder_cycles(planted) == [["p.artifact", "p.model", "p.artifact"]]
    del planted["p.model.runner"]  # the import back gone: none
    assert folder_cycles(planted) == []


def climbs(graph: dict[str, set[str]], stack: list[set[str]]) -> list[str]:
    level = {m: i for i, layer in enumerate(stack) for m in layer}
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if level.get(d, -1) > level.get(m, -1))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_sits_in_one_layer_of_the_design_map_and_imports_none_above_it(package):
    graph, _, _ = import_graph.imports(package)
    stack = layers(package, set(graph))
    placed = [m for layer in stack for m in layer]
    assert sorted(set(graph) - set(placed)) == [] and sorted(set(placed) - set(graph)) == []
    assert len(placed) == len(set(placed))  # one layer each
    assert climbs(graph, stack) == []


def test_a_climbing_import_is_found():
    stack = [{"p.base"}, {"p.top"}]
    assert climbs({"p.base": {"p.top"}, "p.top": {"p.base"}}, stack) == ["p.base -> p.top"]
