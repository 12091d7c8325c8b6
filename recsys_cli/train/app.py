"""`recsys train`: the Hydra app around the Trainer."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from recsys_cli.config import register_configs
from recsys_cli.errors import UserError
from recsys_cli.train import distributed, rundir

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


# Where Hydra would save the composed config (hydra.output_subdir): Hydra
# writes it before the app runs, so a second run in a busy directory would
# overwrite the first one's; the app saves it itself once it holds the lock.
_output_subdir: str | None = ".hydra"


def train_main(cfg: DictConfig) -> float | None:
    from recsys_cli.cli import fail

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        with contextlib.ExitStack() as locks:
            locks.enter_context(rundir.locked(run_dir))
            if cfg.trainer.checkpoint_dir and os.environ.get("RANK", "0") == "0":
                locks.enter_context(rundir.locked(Path(cfg.trainer.checkpoint_dir), "checkpoint directory"))
            if _output_subdir is not None:
                save_hydra_config(cfg, run_dir / _output_subdir)
            return _train(cfg, run_dir)
    except UserError as e:
        fail(str(e))


def save_hydra_config(cfg: DictConfig, directory: Path) -> None:
    """The three files Hydra writes into .hydra/ (config, hydra, overrides)."""
    hydra_cfg = OmegaConf.to_container(HydraConfig.get(), resolve=False)
    hydra_cfg["output_subdir"] = _output_subdir
    directory.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", {"hydra": hydra_cfg}),
                       ("overrides.yaml", HydraConfig.get().overrides.task)):
        (directory / name).write_text(OmegaConf.to_yaml(node))


def _train(cfg: DictConfig, run_dir: Path) -> float | None:
    from recsys_cli.train.progress import summary_table
    from recsys_cli.train.trainer import Trainer

    console = Console()
    if cfg.trainer.nproc > 1 or distributed.launched_by_agent():  # several processes (torchrun, or spawned here)
        return distributed.train_app(cfg, run_dir)
    trainer = Trainer(cfg, run_dir=run_dir, console=console)
    summary = trainer.fit()
    console.print(summary_table(summary))
    console.print(f"run directory: {run_dir}")
    val = summary["final"].get("val")
    return None if val is None else val["auc"]


def run_train_app(overrides: list[str]) -> None:
    register_configs()
    app = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")(train_main)
    global _output_subdir
    overrides = distributed.follower_overrides(overrides)
    for o in overrides:
        if o.lstrip("+").startswith("hydra.output_subdir="):
            value = o.split("=", 1)[1]
            _output_subdir = None if value in ("null", "~", "") else value
    sys.argv = ["recsys train", *overrides, "hydra.output_subdir=null"]
    app()
