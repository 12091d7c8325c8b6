"""Where the commands find their YAML configs: in the installed package.

The repository keeps them at its top level, configs/ (the groups of `recsys
train`) and preprocess_configs/ (`recsys preprocess SOURCE`), where users read
and copy them; pyproject.toml installs those two folders as the packages
recsys_cli._configs and recsys_cli._preprocess_configs, so a wheel or `pip
install .` carries them and an editable install maps them back to the
checkout's folders. Found through the import system, never by a path relative
to this file, so the command runs the same from any directory.
"""

from __future__ import annotations

import importlib
from pathlib import Path

TRAIN = "recsys_cli._configs"
PREPROCESS = "recsys_cli._preprocess_configs"


def config_dir(package: str) -> Path:
    """The folder of the installed config package `package` (a real folder:
    Hydra reads it by path, and an installed wheel is never zipped)."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise RuntimeError(f"{package} is not installed: reinstall recsys (pip install . or make setup)") from None
    if module.__file__ is None:
        raise RuntimeError(f"{package} has no __init__.py: reinstall recsys (pip install . or make setup)")
    return Path(module.__file__).resolve().parent
