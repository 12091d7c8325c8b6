"""Distribution strategies: one object owns what differs between the ways to train (base.py)."""

from __future__ import annotations

from recsys_cli.train.distributed import DistContext
from recsys_cli.train.strategies.base import BatchFeed, Strategy
from recsys_cli.train.strategies.cache_avg import CacheAvg, check
from recsys_cli.train.strategies.grad_sync import GradSync
from recsys_cli.train.strategies.sharded import Sharded
from recsys_cli.train.strategies.single import SingleProcess

__all__ = ["BatchFeed", "CacheAvg", "GradSync", "Sharded", "SingleProcess", "Strategy", "check", "mode_for", "strategy_for"]


def mode_for(cfg, ctx: DistContext) -> str:
    """The mode this process trains in (the `mode` of the strategy strategy_for
    gives): what a resume's start-up line says the run continues in."""
    if not ctx.enabled:
        return SingleProcess.mode
    if cfg.placement.sharding != "replicated":
        return Sharded.mode
    return CacheAvg.mode if cfg.trainer.embedding_sync == "cache_avg" else GradSync.mode


def strategy_for(cfg, ctx: DistContext, model, timer, step: int = 0, saved: dict | None = None) -> Strategy:
    """The strategy of this process: alone, or one rank of trainer.embedding_sync's mode
    (mode_for names it). saved: the resumed checkpoint's strategy state
    (Strategy.state_dict), of any mode and process count; a strategy takes only
    its own mode's state."""
    tc = cfg.trainer
    mode = mode_for(cfg, ctx)
    if mode == SingleProcess.mode:
        return SingleProcess(model.embeddings, tc.batch_size)
    if mode == Sharded.mode:
        return Sharded(model.embeddings, tc.batch_size, ctx, model, timer)
    if mode == CacheAvg.mode:
        return CacheAvg(model.embeddings, tc.batch_size, ctx, model, timer, tc.sync_every, step, saved)
    return GradSync(model.embeddings, tc.batch_size, ctx, model, timer)
