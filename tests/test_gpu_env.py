"""The device check's offline install (tools/gpu_env.py, make gpu-env /
gpu-check / gpu-check-dry): the make target end to end from this test's
Python with no index and no wheel folder (everything it needs is already
installed here, so pip must find it without a download), the stamp that
never lets a venv built for another Python or torch be reused, the torch
floor, and the wheel list following pyproject.toml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tools.gpu_env as gpu_env
from test_gpu_check import assert_every_stage_passed

ROOT = Path(__file__).resolve().parents[1]


def make_gpu_check_dry(tmp_path, stages: list[str] | None) -> dict:
    """`make gpu-check-dry` (of `stages`, or every stage) into a new venv from
    this test's Python, offline; then `make gpu-env` again finds it up to date.
    The report."""
    venv, out = tmp_path / "venv-gpu", tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MAKE"))}
    env["PIP_INDEX_URL"] = "http://127.0.0.1:9/none"  # stripped by gpu_env; were it used, pip would fail
    only = f" --stages {','.join(stages)}" if stages else ""
    command = ["make", "-s", "gpu-check-dry", f"PYTHON={sys.executable}", f"GPU_VENV={venv}",
               f"WHEELS={tmp_path / 'no-wheels'}",
               f"ARGS=--out {out} --cache-dir {tmp_path / 'cache'}{only}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gpu-env: torch {torch.__version__}" in done.stdout and "ok (needs >= 2.11)" in done.stdout
    # recsys beside the venv's python (the CLI tests run it from there), on this Python's torch
    assert (venv / "bin" / "recsys").exists()
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, recsys_cli; print(torch.__file__)"],
                           capture_output=True, text=True, check=True)
    assert Path(probe.stdout.strip()).resolve() == Path(torch.__file__).resolve()
    stamp = json.loads((venv / gpu_env.STAMP).read_text())
    assert stamp["torch"] == torch.__version__ and stamp["python"] == str(Path(sys.executable).absolute())
    report = assert_every_stage_passed(out, stages)
    assert report["python"] == str(venv / "bin" / "python")  # the check ran in the new venv
    again = subprocess.run(command[:2] + ["gpu-env", *command[3:6]], capture_output=True, text=True, cwd=ROOT,
                           env=env)
    assert again.returncode == 0 and "is up to date" in again.stdout, again.stdout + again.stderr
    return report


def test_make_gpu_check_dry_installs_offline_into_its_own_venv_and_runs_the_check_there(tmp_path):
    """The install, and the check in the new venv through its tests stage
    (pytest and the test files, run by that venv's Python) and the sharded
    one (gloo). Every other stage passes in tests/test_gpu_check.py; every
    stage in the new venv: the `make verify` test below."""
    make_gpu_check_dry(tmp_path, ["tests", "sharded"])


@pytest.mark.verify  # ~55 s: each of the 12 stages starts a process that imports torch
def test_make_gpu_check_dry_installs_offline_into_its_own_venv_and_runs_every_stage(tmp_path):
    make_gpu_check_dry(tmp_path, None)


def _stamp(monkeypatch, tmp_path, version="2.13.0+cpu", executable=None):
    monkeypatch.setattr(sys, "executable", executable or sys.executable)
    return gpu_env.wanted_stamp({"version": version, "file": "/x/torch/__init__.py"}, tmp_path)


def test_a_stamp_from_another_python_or_torch_is_never_reused(monkeypatch, tmp_path):
    built = _stamp(monkeypatch, tmp_path)
    assert _stamp(monkeypatch, tmp_path) == built
    assert _stamp(monkeypatch, tmp_path, version="2.11.0+cu130") != built
    assert _stamp(monkeypatch, tmp_path, executable="/opt/other/bin/python") != built
    (tmp_path / "new.whl").write_text("")
    assert _stamp(monkeypatch, tmp_path) != built  # the wheel folder changed


def test_install_rebuilds_a_venv_whose_stamp_differs(monkeypatch, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setattr(gpu_env, "box_torch", lambda: {"version": "2.11.0+cu130", "file": "/x/torch/__init__.py"})
    stale = gpu_env.wanted_stamp({"version": "2.13.0+cpu", "file": "/x/torch/__init__.py"}, tmp_path / "w")
    (venv / gpu_env.STAMP).write_text(json.dumps(stale))
    made = []

    def venv_failed(command, **kwargs):  # stop at the venv's creation: it was going to rebuild
        made.append(command)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(gpu_env.subprocess, "run", venv_failed)
    with pytest.raises(gpu_env.EnvError, match="-m venv failed"):
        gpu_env.install(venv, tmp_path / "w")
    assert not venv.exists() and made[0][1:3] == ["-m", "venv"]  # the stale venv was removed, not reused


@pytest.mark.parametrize("version,ok", [("2.11.0", True), ("2.11.0+cu130", True), ("2.13.0+cpu", True),
                                        ("3.0.1", True), ("2.10.2+cu128", False), ("1.13.1", False), ("x", False)])
def test_torch_floor(version, ok):
    assert gpu_env.torch_version_ok(version) is ok


def test_an_old_torch_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu126")
    assert gpu_env.main(["install", "--venv", "/nonexistent/venv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu-env: torch 2.10.0+cu126 in ") and "needs torch >= 2.11" in err[0]


def test_the_wheel_folder_holds_what_pyproject_needs_beyond_a_gpu_box(tmp_path, monkeypatch):
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = gpu_env.project_requirements()
    assert {gpu_env._name(d) for d in wanted} == {gpu_env._name(d) for d in deps} - gpu_env.BOX_PACKAGES
    assert {"hydra-core", "omegaconf"} <= {gpu_env._name(d) for d in wanted}
    # Python 3.10 has no tomllib: the hand reading gives the same list
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    import builtins

    real_import = builtins.__import__

    def no_tomllib(name, *args, **kwargs):
        if name == "tomllib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tomllib)
    assert gpu_env.project_requirements(tmp_path / "pyproject.toml") == wanted
