"""Starting a Trainer from a checkpoint: resume a run, or initialise a new one from it.

Trainer.resume and Trainer.init_from, apart so that trainer.py reads as the
training loop. A resumed run continues bit for bit (the loader position, RNG,
caches and the metrics so far come back); init_from takes weights and
optimizer state only, and keeps the new run's own step count, data order,
RNGs and hyperparameters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from recsys_cli.errors import UserError
from recsys_cli.train import checkpoint as ckpt
from recsys_cli.train import distributed


def resume(trainer, resume: str) -> None:
    """Trainer.resume: every rank loads the checkpoint rank 0 chose."""
    if str(resume).lower() == "true":
        if trainer.checkpoint_dir is not None and (trainer.checkpoint_dir / ckpt.LATEST).exists():
            path = ckpt.find_checkpoint(trainer.checkpoint_dir)
        else:
            outputs = trainer.run_dir.parent.parent if trainer.run_dir else Path("outputs")
            path = ckpt.find_latest_run_checkpoint(outputs)
    else:
        path = ckpt.find_checkpoint(resume)
    if trainer.dist.enabled:  # every rank loads the checkpoint rank 0 chose
        path = distributed.broadcast_object(path)
    state = ckpt.load_checkpoint(path)
    if "config" in state:
        ckpt.check_resumable(path, state["config"], OmegaConf.to_container(trainer.cfg, resolve=True))
    expected = {f.name: f.vocab_size for f in trainer.manifest.sparse_features}
    if state["features"] != expected:
        raise UserError(f"checkpoint {path} was trained on features {state['features']}, the dataset has {expected}")
    try:
        trainer.model.load_state_dict(state["model"])
        trainer.dense_optimizer.load_state_dict(state["dense_optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:  # a checkpoint of another model that the config check missed
        raise UserError(f"checkpoint {path} does not fit this model: {str(e).splitlines()[0]}") from None
    trainer.embeddings.load_table_state(state["tables"])
    trainer.embeddings.load_cache_snapshot(state.get("caches"), state["step"])
    torch.set_rng_state(state["torch_rng"])
    trainer.step, trainer.epoch, trainer.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
    trainer.samples = state["samples"]
    if "metrics" in state:
        trainer.log.restore(state["metrics"])
        loss, steps = state["running_loss"]
        trainer.running_loss, trainer.running_steps = loss.to(trainer.device), steps
    trainer.saved_step = trainer.step
    if trainer.console is not None:
        trainer.console.print(f"resumed from {path} at step {trainer.step}")

def init_from(trainer, location: str) -> None:
    """Weights and optimizer state (dense and per row) from a checkpoint,
    into this new run: its own step count, data order and RNGs, and its
    own optimizer hyperparameters (lr...)."""
    path = ckpt.find_checkpoint(location)
    if trainer.dist.enabled:
        path = distributed.broadcast_object(path)
    state = ckpt.load_checkpoint(path)
    expected = {f.name: f.vocab_size for f in trainer.manifest.sparse_features}
    if state.get("features") != expected:
        raise UserError(f"vocabulary mismatch: trainer.init_from={path} was trained on features "
                        f"{state.get('features')}, {trainer.dataset_dir} has {expected}")
    ours = trainer.manifest.options.get("vocabulary", {}).get("fingerprint")
    if state.get("vocabulary") and ours and state["vocabulary"] != ours:
        raise UserError(f"vocabulary mismatch: {trainer.dataset_dir} has another vocabulary than the data "
                        f"{path} was trained on (preprocess it with vocab=THAT_DATASET)")
    try:
        trainer.model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(f"trainer.init_from={path}: its model does not fit this config's "
                        f"({str(e).splitlines()[0]})") from None
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in trainer.dense_optimizer.param_groups]
    try:
        trainer.dense_optimizer.load_state_dict(state["dense_optimizer"])
    except ValueError as e:
        raise UserError(f"trainer.init_from={path}: its optimizer state does not fit optimizer."
                        f"name={trainer.cfg.optimizer.name} ({e})") from None
    for group, h in zip(trainer.dense_optimizer.param_groups, hyper):
        group.update(h)
    trainer.embeddings.load_table_state(state["tables"])
    if trainer.console is not None:
        trainer.console.print(f"initialised from {path} (trained {state['step']} steps)")
