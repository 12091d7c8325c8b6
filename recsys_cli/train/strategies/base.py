"""Strategy: how the processes of a run train together (Lightning's strategies).

The trainer runs one loop for every way of distributing; a strategy owns
what differs between them:

  batches()            the training batch feed of an epoch (planned,
                       prefetched, and across ranks made consistent)
  loss_scale()         this rank's weight in the global batch's mean loss
  reduce_gradients()   after backward: gradients (and the loss) across ranks
  after_step()         after the updates of a step (cache_avg's averages)
  before_eval()        before and during an evaluation (caches made current,
  eval_batches()       rows served to every rank), and its results
  gather_predictions()
  checkpoint()         who writes a checkpoint, and who waits for it
  checkpoint_tables()  what of the tables the checkpoint file holds
  samples()            how many samples a step trained, over every rank
  state_dict()         what a checkpoint keeps of it (cache_avg: sync points)

SingleProcess (single.py) is one process: the identities and the plain
prefetcher. GradSync (grad_sync.py) averages every gradient every step;
CacheAvg (cache_avg.py) averages cache rows every k steps (cDLRM).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.cache import CachedGroup


class BatchFeed(Protocol):
    """What batches() returns: a context manager over the epoch's batches.
    passed(step) tells it the trainer is done with `step` (evaluation and
    checkpoint included); window_used: the lookahead window of every batch."""

    window_used: list[int]

    def __enter__(self) -> Iterator[Batch]: ...

    def __exit__(self, *exc) -> None: ...

    def passed(self, step: int) -> None: ...


class Strategy(abc.ABC):
    mode = "single"  # trainer.embedding_sync's mode, or one process alone
    world_size = 1

    def __init__(self, embeddings, global_batch: int) -> None:
        self.embeddings = embeddings
        self.global_batch = global_batch

    def lookahead_groups(self) -> list[tuple[int, CachedGroup]]:
        """(plan index, group) of the groups the prefetcher fills ahead."""
        return [(i, g) for i, g in enumerate(self.embeddings.groups) if g.lookahead]

    @abc.abstractmethod
    def batches(self, loader, limit: int, start: int, pause_at: Callable[[int], bool]) -> BatchFeed:
        """The next `limit` batches of `loader` (steps start, start + 1...),
        ready to train; pause_at(step): a step after which the trainer
        evaluates or checkpoints, so nothing is filled past it meanwhile."""

    def loss_scale(self, batch: Batch) -> float:
        return 1.0

    def reduce_gradients(self, loss: torch.Tensor) -> torch.Tensor:
        """After backward; returns the loss to report."""
        return loss

    def after_step(self, step: int) -> None:
        """`step` steps are done (updates applied, the batch released)."""

    def samples(self, batch: Batch) -> int:
        return batch.size

    def before_eval(self) -> None:
        """Before an evaluation reads any row."""

    def eval_batches(self, loader) -> Iterator[Batch]:
        """The batches of an evaluation, with what the model reads prepared."""
        return iter(loader)

    def gather_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits, labels

    def checkpoint(self, write: Callable[[], Path], directory: Path, step: int) -> Path | None:
        """Write the checkpoint of `step` into `directory` (write() builds and saves the state)."""
        return write()

    def checkpoint_tables(self) -> tuple[dict, list | None]:
        """What a checkpoint's "tables" and "caches" hold: the tables (a snapshot,
        the cache's dirty rows beside them) and what resumes the caches exactly."""
        return self.embeddings.table_state(patch_beside=True), self.embeddings.cache_snapshot()

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the strategy, for a resume (strategy_for's
        `saved`): only its own mode reads more than these two keys."""
        return {"mode": self.mode, "world_size": self.world_size}

    def report(self) -> dict | None:
        """The summary's "distributed" entry (None: not distributed)."""
        return None

    def id_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The run's id counts ([3, F]: batch ids, looked up, distinct) from this rank's."""
        return counts

    def per_rank(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (a small one), in rank order (every rank calls it)."""
        return [tensor]

    def sharding(self) -> dict | None:
        """The summary's "sharding" entry: the shard plan (None: tables replicated)."""
        return None
