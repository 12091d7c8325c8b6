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
    sync at or before j - w (the sync points of each group's _Replica, the
    cache's RowHold), so what may be evicted
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
  * Checkpoints: taken right after a sync, so every replica equals rank 0's
    cache and nothing awaits an average; the sync points and counts are this
    strategy's state (state_dict), restored only on a resume in cache_avg
    mode (with any number of processes) onto the caches they describe.
    Another mode, or one process, resumes the averaged caches and ignores them.
  With sync_every=1 and SGD this equals grad mode (the average of the ranks'
  SGD steps is the SGD step with the averaged gradient); with k > 1, or
  Adagrad, replicas drift apart between syncs.
"""

from __future__ import annotations

import threading

import torch

from recsys_cli.config import cache_avg_low_precision, cache_avg_without_cache
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
    if not cached:  # config.validate refuses it up front, but placement=auto decides only now
        raise UserError(cache_avg_without_cache(cfg.placement.kind))
    if any(g.store.precision != "fp32" for g in cached):
        raise UserError(cache_avg_low_precision(cfg.precision.kind))


class _Replica:
    """cache_avg state of one cached group: which slots this rank touched
    since the last average, how many averages it has done, and the steps
    after which it averaged (sync points). It is the group's RowHold: rows
    of batches since the last sync point at or before a batch's window stay
    resident, so an evicted row is written back with its averaged value.

    `lock` (the strategy's `averaged` condition) guards syncs and points:
    the trainer's thread changes them, the cache reads them (its lock held)."""

    def __init__(self, group: ReplicatedCache, lock: threading.Condition, saved: dict | None) -> None:
        # group: what cache_avg may call on a cache
        self.group = group
        self.lock = lock
        self.unsynced = torch.zeros(group.capacity, dtype=torch.bool)  # only the trainer's thread uses it
        if saved is not None and group.same_cache(saved):  # the cache this state describes, restored
            self.syncs, self.points = saved["syncs"], list(saved["sync_points"])
        else:
            self.syncs, self.points = 0, [group.completed]
        group.hold(self)

    # --- RowHold, called by the cache ----------------------------------------------
    def first_held(self, position: int) -> int:
        with self.lock:
            return self._first_held(position)

    def forget_before(self, batch: int) -> None:
        with self.lock:
            first = self._first_held(batch)
            keep = [p for p in self.points if p >= first]
            self.points = keep if keep else self.points[-1:]

    def _first_held(self, position: int) -> int:
        """The last sync point at or before `position` (lock held)."""
        return max((p for p in self.points if p <= position), default=min(self.points))

    def restart(self, batch: int) -> None:
        with self.lock:
            self.points = [batch]

    # --- the strategy's side ---------------------------------------------------------
    def averaged_at(self, step: int) -> None:
        """Every touched row was averaged (and marked dirty) after `step` steps."""
        with self.lock:
            if self.points[-1] != step:
                self.points.append(step)
            self.syncs += 1
            self.lock.notify_all()

    def state_dict(self) -> dict:
        with self.lock:
            return {**self.group.identity(), "syncs": self.syncs, "sync_points": list(self.points)}


class CacheAvg(DataParallel):
    mode = "cache_avg"

    def __init__(self, embeddings, global_batch, ctx, model, timer, every: int, step: int = 0,
                 saved: dict | None = None) -> None:
        """saved: state_dict() of the run resumed (None: a new run, or one resumed from another mode)."""
        super().__init__(embeddings, global_batch, ctx, model, timer)
        self.every = every
        self.step = step  # steps done
        self.averaged = threading.Condition()  # notified when a replica's syncs grow (cache_fill waits on it)
        saved = saved if saved is not None and saved.get("mode") == self.mode else None
        groups = (saved or {}).get("groups") or [None] * len(embeddings.groups)
        if len(groups) != len(embeddings.groups):
            groups = [None] * len(embeddings.groups)
        self.replicas = {id(g): _Replica(g, self.averaged, s) for g, s in zip(embeddings.groups, groups)
                         if isinstance(g, CachedGroup)}
        counts = (saved or {}).get("counts", {})
        self.syncs = counts.get("syncs", 0)
        self.early_syncs = counts.get("early_syncs", 0)  # asked for by rank 0's prefetcher, to free cache slots
        self.rows_synced = counts.get("rows_synced", 0)

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "groups": [self.replicas[id(g)].state_dict() if id(g) in self.replicas else None
                           for g in self.embeddings.groups],
                "counts": {"syncs": self.syncs, "early_syncs": self.early_syncs, "rows_synced": self.rows_synced}}

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
                    # Dirty before the hold lets the rows go: their averages must reach the table.
                    g.write_slots(slots, values[:, : g.dim], values[:, g.dim :], dirty=True)
                replica.unsynced[slots] = False
                replica.averaged_at(self.step)
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

    def wait_averaged(self, group: CachedGroup, batch: int, stop) -> None:
        """Wait until the rows `group` holds for batch `batch` were averaged
        (after RowsHeld; stop: an Event that ends the wait)."""
        replica = self.replicas[id(group)]
        with self.averaged:
            while replica._first_held(batch) < batch:
                if stop.is_set():
                    raise PrefetchStopped()
                self.averaged.wait(timeout=0.1)

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
                rows = group.read_as_saved(torch.cat(ids)).contiguous()
            else:
                rows = torch.empty(total, group.dim, device=group.device)
            broadcast_(rows, 0, self.ctx.group)
            start = sum(i.numel() for i in ids[: self.ctx.rank])
            plan.rows = rows[start : start + plan.num_unique]

    def report(self):
        return {**super().report(), "sync_every": self.every, "syncs": self.syncs, "early_syncs": self.early_syncs,
                "rows_synced": self.rows_synced}
