"""The import graph of the two packages: every module imports in a fresh
interpreter, there are no cycles, and data_tools never imports recsys_cli.

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
            imported = [f"{module}.{a.name}" for a in node.names]  # `from pkg import module`
            # `from pkg import module` depends on the module as `import pkg.module` does, not on pkg's
            # own names (its __init__, e.g. recsys_cli's lazy public API, runs before any of its modules)
            if node.level or not all(m in MODULES for m in imported):
                named.add(module)
            named.update(imported)
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
