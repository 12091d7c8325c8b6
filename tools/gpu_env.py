"""The device check's environment, installed offline on a CUDA box.

    python tools/gpu_env.py wheels  --dir wheels          (where there is network)
    python tools/gpu_env.py install --venv .venv-gpu --wheels wheels   (on the box)

A GPU box typically has a Python whose torch is built for its CUDA, with
numpy, pyarrow, rich, pytest and matplotlib, and no network. `wheels`
(make gpu-wheels) puts into one folder every wheel the project needs beyond
those (BOX_PACKAGES): the project's own dependencies from pyproject.toml, the
ones they pull in, setuptools to install the project with, and the compiled
ones (PyYAML, xxhash) for every Python and Linux platform a box may have.
`install` (make gpu-check, run by the box's Python) checks that torch is
>= 2.11, then makes a venv that sees the packages that Python sees
(--system-site-packages; run from a venv, that venv's site-packages through a
.pth file, and the base install's only if that venv sees them) and installs the project editable into it with pip --no-index from
the folder: it never downloads, and it never replaces the box's torch. A
stamp in the venv records the Python, its torch and what was installed; a
venv whose stamp differs is rebuilt, never reused.

Only the standard library (and, in `install`, the box's torch): it runs
before the project is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_TORCH = (2, 11)
# What a GPU box brings with its torch; everything else comes from the wheel folder.
BOX_PACKAGES = {"torch", "numpy", "pyarrow", "rich", "pytest", "matplotlib"}
# Compiled wheels, one per Python and platform: PyYAML (omegaconf's) and the
# project's own xxhash (its requirement as pyproject.toml states it).
COMPILED = {"pyyaml": "PyYAML>=5.1", "xxhash": None}
PYTHON_VERSIONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
PLATFORMS = ("manylinux2014_x86_64", "manylinux2014_aarch64")
BUILD_REQUIREMENT = "setuptools>=68"  # pyproject.toml's build-system
STAMP = ".installed"
RECIPE = 1  # bump when install() changes what it makes: older venvs are rebuilt


class EnvError(Exception):
    """A one-line reason the environment cannot be made (exit status 2)."""


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The runtime dependencies of pyproject.toml that a GPU box does not bring."""
    text = pyproject.read_text()
    try:
        import tomllib

        deps = tomllib.loads(text)["project"]["dependencies"]
    except ImportError:  # Python 3.10: the one array this needs, read by hand
        block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1)
        deps = re.findall(r"\"([^\"]+)\"", block)
    return [d for d in deps if _name(d) not in BOX_PACKAGES]


def download_wheels(folder: Path, versions=PYTHON_VERSIONS, platforms=PLATFORMS) -> list[str]:
    """Fill `folder` with the wheels `install` needs (network)."""
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    # The dependencies and theirs, built into wheels where PyPI has only a
    # source archive (antlr4-python3-runtime), so the box never builds one.
    subprocess.run([*pip, "wheel", "-q", "-w", str(folder), *project_requirements(), BUILD_REQUIREMENT],
                   check=True)
    own = {_name(d): d for d in project_requirements()}
    compiled = [own.get(name) or requirement for name, requirement in COMPILED.items() if own.get(name) or requirement]
    for version in versions:
        for platform in platforms:
            subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", version,
                            "--implementation", "cp", "--platform", platform, "-d", str(folder), *compiled],
                           check=True)
    names = sorted(p.name for p in folder.iterdir())
    for unwanted in [n for n in names if _name(n.split("-")[0]) in BOX_PACKAGES]:  # pulled in as a dependency
        (folder / unwanted).unlink()
    return sorted(p.name for p in folder.iterdir())


def torch_version_ok(version: str) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version)
    return bool(match) and (int(match.group(1)), int(match.group(2))) >= MIN_TORCH


def box_torch() -> dict:
    """This Python's torch, checked against MIN_TORCH (one line either way)."""
    try:
        import torch
    except ImportError as e:
        raise EnvError(f"{sys.executable} has no torch ({e}); run with PYTHON=/path/to/the/python/whose/torch/"
                       f"is built for this machine's CUDA") from None
    cuda = torch.version.cuda or "none"
    if not torch_version_ok(torch.__version__):
        raise EnvError(f"torch {torch.__version__} in {sys.executable}: gpu-check needs torch >= "
                       f"{'.'.join(map(str, MIN_TORCH))}")
    available = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if available else "no CUDA device"
    print(f"gpu-env: torch {torch.__version__} (CUDA {cuda}, {device}) from {sys.executable}: ok (needs >= "
          f"{'.'.join(map(str, MIN_TORCH))})", flush=True)
    return {"version": torch.__version__, "file": str(Path(torch.__file__).resolve())}


def parent_site_packages() -> list[str]:
    """The site-packages of the venv this Python is in (none for a system or
    conda Python): a venv made from a venv's Python is made from its base
    install, and would not see the packages of the venv it was made from."""
    if sys.prefix == sys.base_prefix:
        return []
    inside = Path(sys.prefix).resolve()
    return [p for p in site.getsitepackages() if Path(p).is_dir() and Path(p).resolve().is_relative_to(inside)]


def sees_system_site_packages() -> bool:
    """Whether this Python sees its base install's packages (a system or conda
    Python: yes; a venv: as its pyvenv.cfg says): the new venv sees the same."""
    if sys.prefix == sys.base_prefix:
        return True
    try:
        cfg = (Path(sys.prefix) / "pyvenv.cfg").read_text()
    except OSError:
        return False
    return bool(re.search(r"^include-system-site-packages\s*=\s*true\s*$", cfg, re.M | re.I))


def wanted_stamp(torch_info: dict, wheels: Path) -> dict:
    """What the venv must have been built from to be reused."""
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return {
        "recipe": RECIPE,
        "python": str(Path(sys.executable).absolute()),  # not resolved: a venv's python links to its base's
        "prefix": sys.prefix,
        "python_version": sys.version.split()[0],
        "torch": torch_info["version"],
        "torch_file": torch_info["file"],
        "parent_site_packages": parent_site_packages(),
        "system_site_packages": sees_system_site_packages(),
        "pyproject_sha256": pyproject,
        "project": str(ROOT),
        "wheels": sorted(p.name for p in wheels.iterdir()) if wheels.is_dir() else None,
    }


def read_stamp(venv: Path) -> dict | None:
    try:
        return json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return None


def offline_pip_env() -> dict:
    """The environment for the venv's pip: no PIP_* variable and no pip.conf
    (PIP_CONFIG_FILE=os.devnull loads none), so no index or find-links of this
    machine's configuration is consulted; only the command line's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, env=offline_pip_env())
    if done.returncode != 0:
        raise EnvError(f"{what} failed (exit {done.returncode}; pip's output above)")


def install(venv: Path, wheels: Path) -> Path:
    """The venv's Python, with the project installed (reused when its stamp matches)."""
    torch_info = box_torch()
    wanted = wanted_stamp(torch_info, wheels)
    python = venv / "bin" / "python"
    if read_stamp(venv) == wanted and python.exists():
        print(f"gpu-env: {venv} is up to date", flush=True)
        return python
    if venv.exists():
        print(f"gpu-env: rebuilding {venv} (made for another Python, torch or project state)", flush=True)
        shutil.rmtree(venv)
    system_site = ["--system-site-packages"] if sees_system_site_packages() else []
    done = subprocess.run([sys.executable, "-m", "venv", *system_site, str(venv)], env=offline_pip_env())
    if done.returncode != 0:
        raise EnvError(f"{sys.executable} -m venv failed (exit {done.returncode}): this Python needs its venv "
                       "module (Debian: python3-venv)")
    own = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip())
    parents = parent_site_packages()
    if parents:  # after the venv's own site-packages on sys.path, so what pip installs there wins
        (own / "_gpu_env_parent.pth").write_text("".join(p + "\n" for p in parents))
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    if list(own.glob("setuptools-*.dist-info")):
        # Python < 3.12's venv brings an old setuptools (65 in 3.11) that would
        # hide this Python's own: the one this Python has, or the folder's, is used.
        _run([*pip, "uninstall", "-q", "-y", "setuptools"], "removing the venv's bundled setuptools")
    pip += ["install", "-q", "--no-index", *(["--find-links", str(wheels)] if wheels.is_dir() else [])]
    hint = f" from {wheels}/: run `make gpu-wheels` where there is network and copy {wheels}/ here"
    # The build backend first, then the project without build isolation: an
    # isolated build would look for setuptools in the (absent) index.
    _run([*pip, BUILD_REQUIREMENT], "installing " + BUILD_REQUIREMENT + hint)
    _run([*pip, "--no-build-isolation", "-e", str(ROOT)], "installing the project offline" + hint)
    probe = subprocess.run([str(python), "-c", "import torch, hydra, omegaconf, recsys_cli; "
                            "print(torch.__version__); print(torch.__file__)"], capture_output=True, text=True)
    lines = probe.stdout.split()
    if probe.returncode != 0 or lines[:1] != [torch_info["version"]] or \
            str(Path(lines[1]).resolve()) != torch_info["file"]:
        raise EnvError(f"{python} does not import the project with {sys.executable}'s torch: "
                       f"{(probe.stdout + probe.stderr).strip().splitlines()[-1:]}")
    if not (venv / "bin" / "recsys").exists():  # the CLI tests run the script beside sys.executable
        raise EnvError(f"the install made no {venv}/bin/recsys")
    tmp = venv / (STAMP + ".tmp")
    tmp.write_text(json.dumps(wanted, indent=1))
    tmp.replace(venv / STAMP)
    print(f"gpu-env: installed the project into {venv} (python {python})", flush=True)
    return python


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/gpu_env.py")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="download the wheels a GPU box lacks (network)")
    w.add_argument("--dir", default="wheels")
    w.add_argument("--python-versions", default=",".join(PYTHON_VERSIONS))
    w.add_argument("--platforms", default=",".join(PLATFORMS))
    i = sub.add_parser("install", help="the check's venv, offline, on the box's torch")
    i.add_argument("--venv", default=".venv-gpu")
    i.add_argument("--wheels", default="wheels")
    args = parser.parse_args(argv)
    try:
        if args.command == "wheels":
            names = download_wheels(Path(args.dir), args.python_versions.split(","), args.platforms.split(","))
            size = sum((Path(args.dir) / n).stat().st_size for n in names)
            print(f"gpu-env: {len(names)} wheels, {size / 1e6:.1f} MB in {args.dir}/: {', '.join(names)}")
        else:
            install(Path(args.venv).absolute(), Path(args.wheels).absolute())
    except EnvError as e:
        print(f"gpu-env: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"gpu-env: {' '.join(map(str, e.cmd[:6]))} ... failed (exit {e.returncode})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
