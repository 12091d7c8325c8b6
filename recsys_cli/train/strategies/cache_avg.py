"""CacheAvg: cDLRM's inexact mode (trainer.embedding_sync=cache_avg).

fp32 tables behind a lookahead or on-demand cache only:
  * Rank 0 owns the tables and runs the prefetcher for every cached group. It
    fills its cache from its store and broadcasts each fill on the prefetch group
    (cache_fill.py); the other ranks apply those fills to the same slots of
    their cache replica; they never read or write their own table copy while
    training (they hold one only to load checkpoints).
  * Each rank updates its cache replica with its own gradients only (no
    per-step embedding gradient averaging; dense gradients and uncached
    device/host tables are still averaged every step).
  * Sync: every trainer.sync_every steps, and before evaluation and
    checkpoints, all ranks average the cache rows and optimizer state touched
    since the last sync (one all-reduce of those slots; every rank touches the
    union rows, so the set is the same everywhere).
  * Write-back: rank 0 never evicts a row touched since the last sync. A
    batch completes only after its step's sync (if the step has one), and a
    prefetch for batch j with window w protects every batch since the last
    sync at or before j - w (CachedGroup.sync_points), so what may be evicted
    follows from the batch feed, not from how far the trainer got. When
    only such rows could give room, rank 0 asks for a sync early: it puts a
    SYNC marker into its batch feed and broadcasts one to the other ranks,
    which put it at the same place in theirs; every rank syncs when its
    trainer reaches the marker. So an evicted row is written back with its
    averaged value. Each fill carries how many syncs rank 0 had done when it
    made it, and a rank applies the fill only after doing as many itself: a
    slot is reused on every rank only after the sync that freed it.
  * Evaluation: after a sync rank 0's cache and table hold the current rows;
    for every evaluation batch the ranks all-gather their unique ids, rank 0
    reads those rows and broadcasts them.
  With sync_every=1 and SGD this equals grad mode (the average of the ranks'
  SGD steps is the SGD step with the averaged gradient); with k > 1, or
  Adagrad, replicas drift apart between syncs.
"""

from __future__ import annotations

import threading

import torch

from recsys_cli.embeddings.cache import CachedGroup, PrefetchStopped
from recsys_cli.embeddings.protocols import ReplicatedCache
from recsys_cli.errors import UserError
from recsys_cli.train.distributed import all_gather_varlen, all_reduce_mean, broadcast_
from recsys_cli.train.strategies.cache_fill import CacheFillBroadcast
from recsys_cli.train.strategies.grad_sync import DataParallel
from recsys_cli.train.union_plan import union_batches


def check(cfg, embeddings) -> None:
    """cache_avg needs a cache to average: refuse other placements clearly."""
    if cfg.trainer.embedding_sync != "cache_avg":
        return
    cached = [g for g in embeddings.groups if isinstance(g, CachedGroup)]
    if not cached:
        raise UserError(
            f"trainer.embedding_sync=cache_avg averages cache rows, but placement.kind={cfg.placement.kind} "
            "puts no table behind a cache: use placement=lookahead (or cache), or trainer.embedding_sync=grad"
        )
    if any(g.store.precision != "fp32" for g in cached):
        raise UserError(
            f"trainer.embedding_sync=cache_avg needs fp32 tables behind the cache, not precision.kind="
            f"{cfg.precision.kind}: use trainer.embedding_sync=grad"
        )


class _Replica:
    """cache_avg state of one cached group: which slots this rank touched
    since the last average, and how many averages it has done."""

    def __init__(self, group: ReplicatedCache) -> None:  # what cache_avg may call on a cache
        self.group = group
        self.unsynced = torch.zeros(group.capacity, dtype=torch.bool)  # only the trainer's thread uses it
        self.syncs = 0
        group.hold_until_averaged()


class CacheAvg(DataParallel):
    mode = "cache_avg"

    def __init__(self, embeddings, global_batch, ctx, model, timer, every: int, step: int = 0) -> None:
        super().__init__(embeddings, global_batch, ctx, model, timer)
        self.every = every
        self.step = step  # steps done
        self.replicas = {id(g): _Replica(g) for g in embeddings.groups if isinstance(g, CachedGroup)}
        self.averaged = threading.Condition()  # notified when a replica's syncs grow (cache_fill waits on it)
        self.syncs = 0
        self.early_syncs = 0  # asked for by rank 0's prefetcher, to free cache slots
        self.rows_synced = 0

    # --- the step ------------------------------------------------------------------
    def averages_rows(self, group) -> bool:
        return id(group) not in self.replicas

    def rows_touched(self, group, plan) -> None:
        self.replicas[id(group)].unsynced[plan.slots] = True

    def after_step(self, step):
        self.step = step
        if step % self.every == 0:
            self.sync_caches()
        for replica in self.replicas.values():
            replica.group.complete(step)

    def sync_caches(self) -> None:
        """Average every slot touched since the last sync (all ranks call this
        at the same point of the batch feed)."""
        with self.timer.phase("communication"):
            for replica in self.replicas.values():
                g = replica.group
                slots = torch.nonzero(replica.unsynced).flatten()
                values = g.read_slots(slots)
                if slots.numel():
                    all_reduce_mean([values], self.ctx.group)
                g.write_averaged(slots, values, self.step)
                replica.unsynced[slots] = False
                with self.averaged:
                    replica.syncs += 1
                    self.averaged.notify_all()
                self.rows_synced += slots.numel()
            self.syncs += 1

    def wait_syncs(self, group: CachedGroup, syncs: int, stop) -> None:
        """Wait until this rank has averaged `group` `syncs` times (stop: an Event that ends the wait)."""
        replica = self.replicas[id(group)]
        with self.averaged:
            while replica.syncs < syncs:
                if stop.is_set():
                    raise PrefetchStopped()
                self.averaged.wait(timeout=0.1)

    def syncs_of(self, group: CachedGroup) -> int:
        return self.replicas[id(group)].syncs

    def early_sync(self) -> None:
        """A SYNC marker reached the trainer: rank 0's prefetcher needs room."""
        self.early_syncs += 1
        self.sync_caches()

    before_checkpoint = sync_caches

    # --- the batch feed -------------------------------------------------------------
    def batches(self, loader, limit, start, pause_at):
        """Union plans; rank 0 fills every rank's caches."""
        source = union_batches(loader, limit, self.ctx.prefetch_group, pin=self.embeddings.host_pin())
        groups = [(i, g) for i, g in enumerate(self.embeddings.groups) if id(g) in self.replicas]
        return CacheFillBroadcast(source, groups, self.embeddings.release, self, start, pause_at)

    # --- evaluation -------------------------------------------------------------------
    before_eval = sync_caches

    def eval_batches(self, loader):
        for batch in loader:
            self.serve_eval_rows(batch)
            yield batch

    def serve_eval_rows(self, batch) -> None:
        """The rows of cached groups for this evaluation batch, read by rank 0
        (whose cache and table are current) and broadcast."""
        for group, plan in zip(self.embeddings.groups, batch.plans):
            if id(group) not in self.replicas:
                continue
            ids = all_gather_varlen(plan.unique, self.ctx.group)
            total = sum(i.numel() for i in ids)
            if self.ctx.is_main:
                rows = group.read(torch.cat(ids)).contiguous()
            else:
                rows = torch.empty(total, group.dim, device=group.device)
            broadcast_(rows, 0, self.ctx.group)
            start = sum(i.numel() for i in ids[: self.ctx.rank])
            plan.rows = rows[start : start + plan.num_unique]

    def report(self):
        return {**super().report(), "sync_every": self.every, "syncs": self.syncs, "early_syncs": self.early_syncs,
                "rows_synced": self.rows_synced}
