"""Data-parallel strategies, and GradSync: the exact one (trainer.embedding_sync=grad).

Dense parameters are data parallel: one all-reduce per step averages their
gradients. A rank's loss is the mean over its slice of the global batch,
scaled by slice * world / global (1.0 when the slices are equal), so the
average of the ranks' gradients is the gradient of the global batch's mean
loss. Plans are union plans (train/union_plan.py): every rank gathers and
updates the rows of the whole global batch.

GradSync. After backward one all-reduce averages a single flat buffer: every
dense gradient, the gradient of every gathered (union) row of every group,
and the loss. Every rank then applies the same update to the same rows, so
the table replicas never diverge: each rank keeps its own table and fills its
own cache (lookahead or on-demand) with its own prefetcher, from identical
plans. The result is one process's trajectory with the global batch, up to
the rounding of the averaged sums. Residency and rounding are functions of
the batch feed (embeddings/cache.py), so the ranks' replicas stay bitwise
equal in every precision.

Only rank 0 writes checkpoints; the others wait for it at a barrier of the
checkpoint group, whose timeout is not the step's dist_timeout, so a save
longer than that does not fail the run.
"""

from __future__ import annotations

import torch

from recsys_cli.embeddings.prefetch import Prefetcher
from recsys_cli.train.distributed import DistContext, all_gather_varlen, all_reduce_mean, checkpoint_barrier
from recsys_cli.train.memory import peak_rss_bytes
from recsys_cli.train.strategies.base import Strategy
from recsys_cli.train.union_plan import UnionAhead, union_batches


class DataParallel(Strategy):
    """What every multi-process strategy shares: the loss scale, the one
    all-reduce of gradients, evaluation results from every rank, rank 0's
    checkpoints."""

    mode = "grad"

    def __init__(self, embeddings, global_batch: int, ctx: DistContext, model, timer) -> None:
        super().__init__(embeddings, global_batch)
        self.ctx, self.timer = ctx, timer
        self.world_size = ctx.world_size
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        self.reduce_steps, self.reduced_bytes = 0, 0  # the step's all-reduce: what it carried

    def averages_rows(self, group) -> bool:
        """Whether the step's all-reduce averages this group's row gradients."""
        return True

    def loss_scale(self, batch):
        """This rank's weight in the global mean loss (1.0 for equal slices)."""
        return batch.size * self.ctx.world_size / self.global_batch

    def reduce_gradients(self, loss):
        """One all-reduce of dense gradients, row gradients and the loss; returns the global loss."""
        tensors = []
        for p in self.dense_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            tensors.append(p.grad)
        for group, plan, rows in self.embeddings.pending():
            if not self.averages_rows(group):
                self.rows_touched(group, plan)
                continue
            if rows.grad is None:
                rows.grad = torch.zeros_like(rows)
            tensors.append(rows.grad)
        global_loss = loss.detach().reshape(1).clone()
        tensors.append(global_loss)
        with self.timer.phase("communication"):
            all_reduce_mean(tensors, self.ctx.group)
        self.reduce_steps += 1
        self.reduced_bytes += sum(t.numel() for t in tensors) * 4  # all_reduce_mean reduces in fp32
        return global_loss[0]

    def rows_touched(self, group, plan) -> None:
        """A group whose gradients stay local updated the plan's rows this step."""

    def samples(self, batch):
        return self.global_batch

    def gather_predictions(self, logits, labels):
        """Every rank's evaluation logits and labels, on every rank."""
        both = torch.stack([logits.float(), labels.float()], 1)
        gathered = torch.cat(all_gather_varlen(both, self.ctx.group))
        return gathered[:, 0], gathered[:, 1]

    def before_checkpoint(self) -> None:
        """Every rank, before rank 0 writes."""

    def checkpoint(self, write, directory, step):
        self.before_checkpoint()
        path = write() if self.ctx.is_main else None
        checkpoint_barrier()
        return path

    def per_rank(self, tensor):
        return all_gather_varlen(tensor, self.ctx.group)

    def report(self):
        """Every rank calls it (a small all-gather: each rank's peak RSS)."""
        peaks = all_gather_varlen(torch.tensor([peak_rss_bytes()], dtype=torch.int64), self.ctx.group)
        return {"world_size": self.ctx.world_size, "backend": self.ctx.backend, "embedding_sync": self.mode,
                "all_reduce_bytes_per_step": self.reduced_bytes / max(self.reduce_steps, 1),
                "peak_host_rss_bytes_per_rank": [int(p[0]) for p in peaks]}


class GradSync(DataParallel):
    def batches(self, loader, limit, start, pause_at):
        """Union plans, prefetched by every rank for itself (or planned ahead
        on a thread, so the ids' all-gather overlaps the step)."""
        source = union_batches(loader, limit, self.ctx.prefetch_group, pin=self.embeddings.host_pin())
        lookahead = self.lookahead_groups()
        if lookahead:
            return Prefetcher(source, lookahead, self.embeddings.release, start, pause_at)
        return UnionAhead(source)
