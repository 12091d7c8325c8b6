"""Sharded: tables split over the ranks (placement.sharding=table|row|auto).

The dense model is data parallel as in GradSync (one all-reduce of its
gradients and the loss per step); the tables are model parallel: each row
has one owner (embeddings/sharded.py), which updates it from the pooled
gradients routed back to it, so no row gradient is all-reduced and nothing
is replicated. The ids of a batch are routed to their owners on the thread
that plans ahead (the prefetcher's when a shard has a lookahead cache,
otherwise UnionAhead's), on the prefetch group, so the exchange of batch
i+1 overlaps the step of batch i; evaluation routes on the main thread and
group (the training feed may still hold batches in flight then).

Checkpoints: every rank writes its own shards (checkpoints/shard_write.py), rank
0 the rest of the state beside them.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import torch

from recsys_cli import checkpoints as ckpt
from recsys_cli.embeddings.prefetch import Prefetcher, take
from recsys_cli.train.distributed import all_gather_varlen
from recsys_cli.train.strategies.grad_sync import DataParallel
from recsys_cli.train.union_plan import UnionAhead


def routed_batches(loader, limit: int, embeddings, group, pin=None) -> Generator:
    """The next `limit` batches of `loader`, their ids routed to the owners;
    `pin` (CUDA: the runtime's) pins the owner's plans, made here rather than
    on the loader thread, so their copies to the device stay asynchronous."""
    source = take(loader, limit)
    try:
        for batch in source:
            batch = embeddings.route(batch, group)
            if pin is not None and batch.plans:
                batch.plans = [plan.pin_memory(pin) for plan in batch.plans]
            yield batch
    finally:  # the loader's reader thread stops with it
        source.close()


class Sharded(DataParallel):
    mode = "sharded"
    _shards: Path | None = None  # the shard directory of the checkpoint being written


    def averages_rows(self, group) -> bool:
        return False  # each owner updates its rows from the gradients routed back to it

    def batches(self, loader, limit, start, pause_at):
        source = routed_batches(loader, limit, self.embeddings, self.ctx.prefetch_group, pin=self.embeddings.host_pin())
        lookahead = self.lookahead_groups()
        if lookahead:
            return Prefetcher(source, lookahead, self.embeddings.release, start, pause_at)
        return UnionAhead(source)

    def eval_batches(self, loader):
        for batch in loader:
            yield self.embeddings.route(batch, self.ctx.group)

    def checkpoint(self, write, directory, step):
        """Every rank writes its shards and caches (one collective save, on the
        checkpoint group: a large save may outlast the step's timeout), then
        rank 0 the rest, its "tables" a reference to them."""
        self._shards = ckpt.shard_dir(directory, step)
        pieces = {}
        state = self.embeddings.table_state(patch_beside=True)
        for group in self.embeddings.groups:
            for t in group.tables:
                pieces[t.name] = (t.first_row, t.first_row + t.num_rows, state[t.name])
        ckpt.save_shards(self._shards, pieces, self.embeddings.cache_snapshot(), self.ctx.rank,
                         self.ctx.world_size, group=self.ctx.checkpoint_group, space_note=ckpt.space_note)
        return super().checkpoint(write, directory, step)

    def id_counts(self, counts):
        """Each owner counted the global batch's ids of its own shards: their sum (every rank calls it)."""
        total = counts.clone()
        torch.distributed.all_reduce(total, group=self.ctx.prefetch_group)  # gloo: host int64
        return total

    def checkpoint_tables(self):
        if self._shards is None:  # the tables live in the shard directory that checkpoint() writes first
            raise RuntimeError("a sharded run's checkpoint state is built inside Sharded.checkpoint")
        return ckpt.tables_reference(self._shards, self.embeddings.plan.to_dict()), None

    def report(self):
        """Every rank calls it: the bytes each rank sent per step, and their largest (ranks send unequal amounts)."""
        mine = self.embeddings.exchange_report()
        every = all_gather_varlen(torch.tensor([list(mine.values())], dtype=torch.float64), self.ctx.group)
        per_rank = {k: [float(r[0, i]) for r in every] for i, k in enumerate(mine)}
        return {**super().report(), "sharding": self.embeddings.plan.kind,
                **{k: max(v) for k, v in per_rank.items()}, **{f"{k}_per_rank": v for k, v in per_rank.items()}}

    def sharding(self):
        return self.embeddings.plan.to_dict()
