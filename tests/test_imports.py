"""The import graph of the two packages: every module imports in a fresh
interpreter, there are no cycles, the packages form the stack LAYERS names
(a module imports only from its own floor or below), and data_tools never
imports recsys_cli. `python tests/test_imports.py` prints the floors.

The graph is read from the source (ast), counting every import, also the ones
inside functions: a function-level import that closes a cycle only moves the
cycle from import time to call time.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_tools", "recsys_cli")
# Cycles that exist and have an owner removing them; the test fails on any
# other cycle, and on one of these growing.
KNOWN_CYCLES: list[set[str]] = []  # none: a new cycle fails the test

# The stack, top floor first (docs/architecture.md, "Layers"): a unit (a
# subpackage of recsys_cli, a top-level module, or data_tools) imports only
# units of a lower floor. Training and inference both stand on the checkpoint
# format; neither reaches into the other. Units not named here (the
# foundations: errors, config, checksum, safe_load, ...) are free but for cycles.
LAYERS: list[set[str]] = [
    {"cli"},
    {"evaluate", "export", "verify"},
    {"predict"},
    {"inference", "train"},
    {"checkpoints", "model"},
    {"embeddings"},
    {"data"},
    {"data_tools"},
]
# The arrows up that stay, each with its reason (module -> module).
ARROWS_UP = {
    ("recsys_cli.data.batch", "recsys_cli.embeddings.plan"),  # TYPE_CHECKING only: the type of a batch's plans
    # `python -m recsys_cli.safe_load upgrade` (safe_load.upgrade, at call time)
    # rewrites a checkpoint's record; record.py imports nothing of recsys_cli but checksum.
    ("recsys_cli.safe_load", "recsys_cli.checkpoints.record"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":  # runs the CLI when imported
                continue
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Modules of the two packages that `name` imports (anywhere in its source)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            named.add(module)
            named.update(f"{module}.{a.name}" for a in node.names)  # `from pkg import module`
    out = set()
    for m in named:
        while m and m not in MODULES:
            m = m.rpartition(".")[0]
        if m and m != name:
            out.add(m)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_imports():
    assert "recsys_cli.errors" in GRAPH["recsys_cli.cli"]
    assert "recsys_cli.train.app" in GRAPH["recsys_cli.cli"]  # imported inside main()
    assert "data_tools.manifest" in GRAPH["recsys_cli.data.loader"]


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    unexpected = [c for c in cycles if not any(c <= known for known in KNOWN_CYCLES)]
    assert not unexpected, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in unexpected)


def unit(module: str) -> str:
    """The unit of LAYERS a module belongs to."""
    parts = module.split(".")
    if parts[0] == "data_tools":
        return "data_tools"
    return parts[1] if len(parts) > 1 else parts[0]


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each unit's floor: 1 for a unit that imports no other, else one above
    the highest unit it imports (the graph between units, without ARROWS_UP)."""
    units: dict[str, set[str]] = {}
    for name, deps in graph.items():
        units.setdefault(unit(name), set()).update(
            unit(d) for d in deps if unit(d) != unit(name) and (name, d) not in ARROWS_UP)
    out: dict[str, int] = {}

    def floor(u: str, path: tuple[str, ...] = ()) -> int:
        if u in path:
            raise ValueError("units import each other: " + " -> ".join((*path, u)))
        if u not in out:
            out[u] = 1 + max((floor(d, (*path, u)) for d in units[u]), default=0)
        return out[u]

    for u in sorted(units):
        floor(u)
    return out


def test_floors_follow_the_arrows():
    assert floors({"recsys_cli.a.x": {"recsys_cli.b.y"}, "recsys_cli.b.y": set(), "recsys_cli.c": {"recsys_cli.a.x"}}) \
        == {"a": 2, "b": 1, "c": 3}
    assert unit("recsys_cli.checkpoints.write") == "checkpoints" and unit("data_tools.shards") == "data_tools"


def test_the_packages_form_the_stack():
    """No import climbs: each module imports only units below its own in
    LAYERS (or its own unit), except the ARROWS_UP. The checkpoint format
    (recsys_cli/checkpoints/) sits below both training and inference."""
    level = {u: len(LAYERS) - i for i, floor in enumerate(LAYERS) for u in floor}
    up = sorted(f"{name} -> {d}" for name, deps in GRAPH.items() for d in deps
                if unit(name) != unit(d) and unit(name) in level and unit(d) in level
                and level[unit(d)] >= level[unit(name)] and (name, d) not in ARROWS_UP)
    assert not up, "imports that climb the stack: " + "; ".join(up)
    assert all(u in {unit(m) for m in GRAPH} for floor in LAYERS for u in floor)  # no stale name
    assert ARROWS_UP <= {(name, d) for name, deps in GRAPH.items() for d in deps}  # each still exists
    assert "recsys_cli.checkpoints" in {d for d in GRAPH["recsys_cli.inference"] | GRAPH["recsys_cli.train.trainer"]}


def test_data_tools_never_imports_recsys_cli():
    bad = {name: sorted(m for m in deps if m.startswith("recsys_cli"))
           for name, deps in GRAPH.items() if name.startswith("data_tools")}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"data_tools modules importing recsys_cli: {bad}"


def _fresh(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(MODULES)
    got = _fresh(
        "import importlib, json, sys\n"
        f"names = {names!r}\n"
        "for n in names: importlib.import_module(n)\n"
        "print(json.dumps(sorted(n for n in names if n in sys.modules)))\n"
    )
    assert got == names


def test_data_tools_imports_without_recsys_cli():
    names = sorted(n for n in MODULES if n.split(".")[0] == "data_tools")
    loaded = _fresh(
        "import importlib, json, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'recsys_cli')))\n"
    )
    assert loaded == []


def test_test_files_run_alone_from_any_directory(tmp_path):
    """A test file run on its own (pytest's own entry point, from another
    directory: nothing puts the checkout on sys.path but the pytest
    configuration) collects: the files that import bench/, the shared
    helpers and each other's fixtures."""
    # One pytest for all (each start costs seconds); the files that need bench/
    # come first, so nothing a later file does to sys.path can help them.
    files = ["tests/test_sharding.py", "tests/test_gpu_check.py", "tests/test_cache_streams.py",
             "tests/test_device_paths.py"]
    done = subprocess.run([sys.executable, "-c", "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))",
                           "-p", "no:cacheprovider", "--collect-only", "-q", *(str(ROOT / name) for name in files)],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert all(f"{name}: " in done.stdout for name in files), done.stdout[-2000:]  # each collected


if __name__ == "__main__":  # the floors, top first
    by_floor: dict[int, list[str]] = {}
    for name, f in floors(GRAPH).items():
        by_floor.setdefault(f, []).append(name)
    for f in sorted(by_floor, reverse=True):
        print(f, " ".join(sorted(by_floor[f])))
