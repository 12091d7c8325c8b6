"""docs/architecture.md names real code: every module path, class, function,
attribute, config key, thread name, file a run writes and command it puts
in backticks exists.

Names resolve by importing and getattr where the code makes them at import
time (modules, classes, functions, class attributes, dataclass fields);
attributes an instance sets (``self.x = ...``) and role-qualified names
(``group.update``, ``strategy.after_step``) resolve against the syntax trees
of the package's sources, so a rename that the page missed fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from functools import cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("recsys_cli", "data_tools")
# "group.update": the page's words for the objects a name is called on.
ROLES = {"group": ("CachedGroup", "TableGroup"), "strategy": ("Strategy",), "embeddings": ("EmbeddingBagCollection",)}
CONFIG_GROUPS = ("trainer", "placement", "precision", "model", "dataset", "optimizer", "dedup")
IDENT = r"[A-Za-z_]\w*"


def page_text() -> str:
    return PAGE.read_text()


def backticked(text: str) -> list[str]:
    """Inline code spans outside fenced blocks (the mermaid chart holds labels, not names)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return sorted(set(re.findall(r"`([^`\n]+)`", prose)))


@dataclasses.dataclass
class Index:
    files: list[str]  # source paths relative to ROOT
    modules: dict[str, str]  # top-level class or function name -> module defining it
    attributes: dict[str, set[str]]  # class name -> methods, class-level names, self.X assignments
    bases: dict[str, list[str]]  # class name -> base class names
    defined: set[str]  # every name the sources define, import or assign
    source: str  # all sources, for string literals (thread names)


@cache
def index() -> Index:
    files, modules, attributes, bases, defined, texts = [], {}, {}, {}, set(), []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            files.append(rel)
            module = rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            text = path.read_text()
            texts.append(text)
            tree = ast.parse(text)
            for node in tree.body:
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    modules.setdefault(node.name, module)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    names = attributes.setdefault(node.name, set())
                    bases.setdefault(node.name, []).extend(
                        b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                        if isinstance(b, (ast.Name, ast.Attribute)))
                    for sub in ast.walk(node):
                        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            names.add(sub.name)
                        elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                                and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                            names.add(sub.attr)
                        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                            names.add(sub.target.id)
                        elif isinstance(sub, ast.Assign):
                            names.update(t.id for t in sub.targets if isinstance(t, ast.Name))
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    defined.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    defined.add(node.target.id)
                elif isinstance(node, ast.alias):
                    defined.add((node.asname or node.name).split(".")[-1])
    return Index(files, modules, attributes, bases, defined, "\n".join(texts))


def class_has(name: str, attr: str) -> bool:
    """`name` (a class of the package) or one of its bases has `attr`, at import time or set by an instance."""
    idx = index()
    module = idx.modules.get(name)
    if module is not None:
        cls = getattr(importlib.import_module(module), name)
        if hasattr(cls, attr) or (dataclasses.is_dataclass(cls) and attr in {f.name for f in dataclasses.fields(cls)}):
            return True
    return attr in idx.attributes.get(name, set()) or any(class_has(b, attr) for b in idx.bases.get(name, []))


def resolves(token: str) -> bool:
    idx = index()
    name = re.sub(r"\(.*\)$", "", token)  # CachedGroup.prepare(plan) -> CachedGroup.prepare
    if re.fullmatch(r"[\w/]+\.py", name):
        return any(f == name or f.endswith("/" + name) for f in idx.files)
    if re.fullmatch(r"[\w/.-]+\.(json|jsonl|csv|log|pt)", name):  # a file the run writes: its name is in the code
        return name.rsplit("/", 1)[-1] in idx.source
    if name.startswith("recsys ") and re.fullmatch(r"recsys [a-z]+", name):  # a subcommand
        return f'"{name.split()[1]}"' in (ROOT / "recsys_cli" / "cli.py").read_text()
    if re.fullmatch(r"[\w-]+(<\w+>[\w-]*)*", name) and "-" in name:  # a thread name, <...> filled in at run time
        return name.split("<")[0] in idx.source
    if not re.fullmatch(rf"{IDENT}(\.{IDENT})*", name):
        return False
    first, *rest = name.split(".")
    if first in PACKAGES:
        for cut in range(len(rest), -1, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join([first, *rest[:cut]]))
            except ModuleNotFoundError:
                continue
            for attr in rest[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False
    if first in CONFIG_GROUPS and rest:
        from recsys_cli.config import TrainConfig

        cfg = OmegaConf.structured(TrainConfig)
        parent = OmegaConf.select(cfg, ".".join([first, *rest[:-1]]))
        return parent is not None and rest[-1] in parent
    if first in ROLES and rest:
        return len(rest) == 1 and any(class_has(c, rest[0]) for c in ROLES[first])
    if rest:
        return first in idx.attributes and len(rest) == 1 and class_has(first, rest[0])
    return name in idx.defined


def test_the_page_lists_names():
    """The parser finds the page's names (an empty list would pass anything)."""
    names = backticked(page_text())
    assert {"CachedGroup.prepare", "DistContext.checkpoint_group", "recsys-disk-io", "trainer.dist_timeout"} <= set(names)


def test_every_name_on_the_architecture_page_exists():
    missing = [t for t in backticked(page_text()) if not resolves(t)]
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"


def test_every_file_the_page_names_exists():
    paths = sorted(set(re.findall(r"\b(?:\w+/)+\w+\.py\b", page_text())))
    assert len(paths) > 5
    assert [p for p in paths if not resolves(p)] == []


@pytest.mark.parametrize("token", ["CachedGroup.sync_points", "PlanAhead", "strategy.average_now",
                                   "recsys_cli.embeddings.planner", "trainer.no_such_key", "recsys-plan",
                                   "embeddings/nowhere.py", "NeedsAverage", "checkpoints/nowhere.json"])
def test_a_stale_name_does_not_resolve(token):
    """The names the page once had, and made-up ones, fail: the check can fail."""
    assert not resolves(token)
