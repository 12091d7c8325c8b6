"""`recsys train`: the Hydra app around the Trainer."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console

from recsys_cli.config import register_configs
from recsys_cli.errors import UserError
from recsys_cli.train import distributed

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def train_main(cfg: DictConfig) -> float | None:
    from recsys_cli.train.progress import summary_table
    from recsys_cli.train.trainer import Trainer

    console = Console()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.trainer.nproc > 1 or distributed.launched_by_agent():  # several processes (torchrun, or spawned here)
        return distributed.train_app(cfg, run_dir)
    try:
        trainer = Trainer(cfg, run_dir=run_dir, console=console)
        summary = trainer.fit()
    except UserError as e:
        from recsys_cli.cli import fail

        fail(str(e))
    console.print(summary_table(summary))
    console.print(f"run directory: {run_dir}")
    val = summary["final"].get("val")
    return None if val is None else val["auc"]


def run_train_app(overrides: list[str]) -> None:
    register_configs()
    app = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")(train_main)
    sys.argv = ["recsys train", *distributed.follower_overrides(overrides)]
    app()
