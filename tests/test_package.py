"""The package as a user gets it (issue 42, item 6): a wheel built from the
checkout installs into a fresh environment a `recsys` that runs its commands
from any directory, on the configs it carries; `recsys --version` names the
version in pyproject.toml."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import recsys_cli
from recsys_cli.cli import main

REPO = Path(__file__).resolve().parents[1]
# What building the wheel reads (pyproject.toml: the readme, the packages and
# the two config folders mapped into recsys_cli); copied, so that the build
# writes nothing into the checkout (pip builds in the source tree).
BUILD_INPUTS = ["pyproject.toml", "README.md", "recsys_cli", "data_tools", "configs", "preprocess_configs"]
# Where the wheel puts each checkout folder.
INSTALLED_AS = {"recsys_cli": "recsys_cli", "data_tools": "data_tools", "configs": "recsys_cli/_configs",
                "preprocess_configs": "recsys_cli/_preprocess_configs"}


def pyproject_version() -> str:
    match = re.search(r'(?m)^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text())
    assert match, "pyproject.toml has no version line"
    return match.group(1)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_pyprojects(flag, capsys):
    main([flag])
    out = capsys.readouterr().out
    assert version("recsys") == pyproject_version()  # the installed metadata is the checkout's (make setup)
    assert out.startswith(f"recsys {pyproject_version()} from {Path(recsys_cli.__file__).resolve().parent} ")
    assert out.count("\n") == 1


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} -> exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(REPO / name, src / name)
    # Offline: the build runs on this environment's setuptools (pyproject's build-system).
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
          "-w", str(tmp / "dist"), str(src)], tmp)
    (wheel,) = (tmp / "dist").glob("recsys-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> tuple[Path, Path]:
    """A new venv with the wheel installed (no dependencies): its bin/ and site-packages."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)], tmp)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).strip())
    # torch, Hydra and the rest from this environment, after the venv's own
    # packages on sys.path; added after the install, so pip saw only the new venv.
    # A path in a .pth file runs no .pth file of its own: this environment's
    # editable install of the checkout stays out.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return venv / "bin", site


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_every_module_and_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, installed in INSTALLED_AS.items():
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                name = f"{installed}/{path.relative_to(REPO / folder).as_posix()}"
                assert name in names, f"{folder}/{path.relative_to(REPO / folder)} is not in the wheel (as {name})"
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)


@pytest.mark.slow
def test_installed_wheel_runs_from_any_directory(wheel, tmp_path):
    """Build, install into a fresh venv, and run every kind of command from a
    folder outside the checkout: the code and the configs are the installed
    ones, never the checkout's."""
    bin_dir, site = _fresh_venv(tmp_path, wheel)
    recsys = str(bin_dir / "recsys")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RECSYS_CACHE"] = str(tmp_path / "cache")

    out = _run([recsys, "--version"], work, env)
    assert out.startswith(f"recsys {pyproject_version()} from {site / 'recsys_cli'} "), out
    assert "usage: recsys COMMAND" in _run([recsys, "--help"], work, env)

    _run([recsys, "preprocess", "synthetic", "rows=2000", "cardinality_scale=0.0005", "output=data",
          "progress=false"], work, env)
    assert (work / "data" / "manifest.json").is_file()
    _run([recsys, "train", "dataset.path=data", "trainer.max_steps=2", "trainer.progress=false",
          "hydra.run.dir=run"], work, env)
    assert json.loads((work / "run" / "summary.json").read_text())
    sources = yaml.safe_load((work / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["config_sources"]
    assert {"path": str(site / "recsys_cli" / "_configs"), "schema": "file", "provider": "main"} in sources
    _run([recsys, "predict", "checkpoint=run", "input=data", "output=preds.csv"], work, env)
    assert len((work / "preds.csv").read_text().splitlines()) == 1 + 2000
    found = _run([str(bin_dir / "python"), "-c", "import data_tools, recsys_cli.preprocess as p, recsys_cli.train.app as t;"
                  "print(data_tools.__file__, p.CONFIG_DIR, t.CONFIG_DIR, sep='\\n')"], work, env).split()
    assert found == [str(site / "data_tools" / "__init__.py"), str(site / "recsys_cli" / "_preprocess_configs"),
                     str(site / "recsys_cli" / "_configs")]
    assert sorted(p.name for p in work.iterdir()) == ["data", "preds.csv", "run"]  # nothing else written here
