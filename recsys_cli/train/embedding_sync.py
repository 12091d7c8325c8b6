"""Embedding rows across ranks: union plans, and the two ways to keep tables in step.

Every rank trains on its own contiguous slice of each global batch
(ShardLoader rank/world_size; trainer.batch_size is the global batch). Dense
parameters are data parallel: one all-reduce per step averages their
gradients. A rank's loss is the mean over its slice, scaled by
slice * world / global (1.0 when the slices are equal), so the average of the
ranks' gradients is the gradient of the global batch's mean loss.

Union plans. A rank's lookup plan covers the rows of its slice only, but in
both modes every rank must hold, and update, the rows of the whole global
batch. So every rank replaces each plan's unique row ids by their union over
the ranks (an all-gather of the unique ids, padded to the longest) and remaps
its inverse index into the union. The union is sorted: it is exactly the plan
one process would make for the global batch (the same rows in the same order,
the same cache fills), and rows outside the rank's slice simply get a zero
gradient from it. Chosen over "every rank reads the whole global batch"
because the loader then decodes only the rank's slice; the price is one small
all-gather of ids per batch. It runs on the thread that plans batches ahead
(the prefetcher thread when a group has a lookahead cache, otherwise a small
planning thread), so it overlaps training; always on the gloo plan group
(distributed.py), so its collectives never interleave with the main thread's.
Every rank plans exactly the batches it will train (the stream is cut at the
end of the epoch or at max_steps), so these collectives always pair up.

trainer.embedding_sync=grad (exact). After backward one all-reduce averages a
single flat buffer: every dense gradient, the gradient of every gathered
(union) row of every group, and the loss. Every rank then applies the same
update to the same rows, so the table replicas never diverge: each rank keeps
its own table and fills its own cache (lookahead or on-demand) with its own
prefetcher, from identical plans. The result is one process's trajectory with
the global batch, up to the rounding of the averaged sums. Residency and
rounding are functions of the batch stream (embeddings/cache.py), so the
ranks' replicas stay bitwise equal in every precision.

trainer.embedding_sync=cache_avg (cDLRM's inexact mode; fp32 tables behind a
lookahead or on-demand cache only):
  * Rank 0 owns the tables and runs the prefetcher for every cached group. It
    fills its cache from its store and broadcasts each fill on the plan group:
    the slot of every union row (the slot plan) and the rows it loaded with
    their optimizer state. The other ranks copy those rows into the same slots
    of their cache replica; they never read or write their own table copy while
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
    follows from the batch stream, not from how far the trainer got. When
    only such rows could give room, rank 0 asks for a sync early: it puts a
    SYNC marker into its batch stream and broadcasts one to the other ranks,
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

import queue
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.cache import CachedGroup, PrefetchStopped
from recsys_cli.embeddings.collection import PLANS, EmbeddingCollection
from recsys_cli.embeddings.prefetch import Prefetcher
from recsys_cli.errors import UserError
from recsys_cli.train.distributed import DistContext, all_gather_split, all_gather_varlen, all_reduce_mean, broadcast_

_DONE = object()
_SYNC = object()  # in a batch stream: every rank averages its cache rows here
FILL, SYNC = 1, 2  # kinds of rank 0's messages on the plan group


def check(cfg, embeddings: EmbeddingCollection) -> None:
    """cache_avg needs a cache to average: refuse other placements clearly."""
    if cfg.trainer.embedding_sync != "cache_avg":
        return
    cached = [g for g in embeddings.groups if isinstance(g, CachedGroup)]
    if not cached:
        raise UserError(
            f"trainer.embedding_sync=cache_avg averages cache rows, but placement.kind={cfg.placement.kind} "
            "puts no table behind a cache: use +placement=lookahead (or cache), or trainer.embedding_sync=grad"
        )
    if any(g.store.precision != "fp32" for g in cached):
        raise UserError(
            f"trainer.embedding_sync=cache_avg needs fp32 tables behind the cache, not precision.kind="
            f"{cfg.precision.kind}: use trainer.embedding_sync=grad"
        )


def union_plan(batch: Batch, group) -> Batch:
    """Replace every plan's unique ids by their union over the ranks (sorted)
    and remap the inverse index; the rank's own count stays in extras."""
    plans = batch.extras[PLANS]
    per_rank = all_gather_split([p.unique for p in plans], group)
    for g, plan in enumerate(plans):
        union = torch.unique(torch.cat([parts[g] for parts in per_rank]), sorted=True)
        plan.extras["local_unique"] = plan.num_unique
        plan.widen(union)
    return batch


def union_batches(loader, limit: int, group) -> Iterator[Batch]:
    """The next `limit` batches of `loader`, with union plans."""
    it = iter(loader)
    try:
        for _ in range(limit):
            batch = next(it, None)
            if batch is None:
                return
            yield union_plan(batch, group)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class _Replica:
    """cache_avg state of one cached group."""

    def __init__(self, group: CachedGroup) -> None:
        self.group = group
        self.unsynced = torch.zeros(group.capacity, dtype=torch.bool)  # slots touched since the last sync
        self.syncs = 0
        group.completes_on_release = False  # a batch completes after its step's sync (after_step)
        if group.sync_points is None:  # a resumed cache keeps the sync points it was saved with
            group.sync_points = [group.completed]


class EmbeddingSync:
    """The distributed half of a training step (see the module docstring)."""

    def __init__(self, cfg, ctx: DistContext, model, timer, step: int = 0) -> None:
        self.ctx, self.timer = ctx, timer
        self.step = step  # steps done
        self.model = model
        self.embeddings: EmbeddingCollection = model.embeddings
        self.mode = cfg.trainer.embedding_sync
        self.every = cfg.trainer.sync_every
        self.global_batch = cfg.trainer.batch_size
        check(cfg, self.embeddings)
        self.replicas: dict[int, _Replica] = {}
        if self.mode == "cache_avg":
            self.replicas = {id(g): _Replica(g) for g in self.embeddings.groups if isinstance(g, CachedGroup)}
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        self.syncs = 0
        self.early_syncs = 0  # asked for by rank 0's prefetcher, to free cache slots
        self.rows_synced = 0

    # --- the step ------------------------------------------------------------------
    def loss_scale(self, batch: Batch) -> float:
        """This rank's weight in the global mean loss (1.0 for equal slices)."""
        return batch.size * self.ctx.world_size / self.global_batch

    def average_gradients(self, loss: torch.Tensor) -> torch.Tensor:
        """One all-reduce of dense gradients, row gradients (grad mode, and
        uncached groups in cache_avg) and the loss; returns the global loss.
        cache_avg: marks the cache slots this step touches."""
        tensors = []
        for p in self.dense_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            tensors.append(p.grad)
        for group, plan, rows in self.embeddings.pending():
            replica = self.replicas.get(id(group))
            if replica is not None:
                with group.cond:
                    replica.unsynced[plan.slots] = True
                continue
            if rows.grad is None:
                rows.grad = torch.zeros_like(rows)
            tensors.append(rows.grad)
        global_loss = loss.detach().reshape(1).clone()
        tensors.append(global_loss)
        with self.timer.phase("communication"):
            all_reduce_mean(tensors, self.ctx.group)
        return global_loss[0]

    def after_step(self, step: int) -> None:
        self.step = step
        if not self.replicas:
            return
        if step % self.every == 0:
            self.sync_caches()
        for replica in self.replicas.values():
            replica.group.complete(step)

    def sync_caches(self) -> None:
        """cache_avg: average every slot touched since the last sync (all ranks
        call this at the same point of the batch stream)."""
        if not self.replicas:
            return
        with self.timer.phase("communication"):
            for replica in self.replicas.values():
                g = replica.group
                with g.cond:
                    slots = torch.nonzero(replica.unsynced).flatten()
                if slots.numel():
                    dev = slots.to(g.device)
                    buf = torch.cat([g.cache_rows.index_select(0, dev), g.cache_state.index_select(0, dev)], 1)
                    all_reduce_mean([buf], self.ctx.group)
                    g.write_slots(slots, buf[:, : g.dim], buf[:, g.dim :])  # write-backs wait for this write
                with g.cond:
                    replica.unsynced[slots] = False
                    g.dirty[slots] = True  # the averaged value must reach the table
                    replica.syncs += 1
                    if g.sync_points[-1] != self.step:
                        g.sync_points.append(self.step)
                    g.cond.notify_all()
                self.rows_synced += slots.numel()
            self.syncs += 1

    before_eval = sync_caches
    before_checkpoint = sync_caches

    # --- the batch stream -------------------------------------------------------------
    def batches(self, loader, limit: int, lookahead: list[tuple[int, CachedGroup]], start: int = 0, pause_at=None):
        """The next `limit` batches with union plans, prefetched: by every rank
        for itself (grad), or by rank 0 for all (cache_avg). A context manager
        like Prefetcher (start, pause_at: see there)."""
        source = union_batches(loader, limit, self.ctx.plan_group)
        if not self.replicas:
            if lookahead:
                return Prefetcher(source, lookahead, self.embeddings.release, start, pause_at)
            return PlanAhead(source)
        groups = [(i, g) for i, g in enumerate(self.embeddings.groups) if id(g) in self.replicas]
        return CacheAvgPrefetcher(source, groups, self.embeddings.release, self, start, pause_at)

    # --- evaluation -------------------------------------------------------------------
    def serve_eval_rows(self, batch: Batch) -> None:
        """cache_avg: the rows of cached groups for this evaluation batch, read
        by rank 0 (whose cache and table are current) and broadcast."""
        if not self.replicas:
            return
        for group, plan in zip(self.embeddings.groups, batch.extras[PLANS]):
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
            plan.extras["rows"] = rows[start : start + plan.num_unique]

    def gather_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's evaluation logits and labels, on every rank."""
        both = torch.stack([logits.float(), labels.float()], 1)
        gathered = torch.cat(all_gather_varlen(both, self.ctx.group))
        return gathered[:, 0], gathered[:, 1]

    def report(self) -> dict:
        out = {"world_size": self.ctx.world_size, "backend": self.ctx.backend, "embedding_sync": self.mode}
        if self.mode == "cache_avg":
            out.update(sync_every=self.every, syncs=self.syncs, early_syncs=self.early_syncs,
                       rows_synced=self.rows_synced)
        return out


class PlanAhead:
    """Union planning on its own thread, a few batches ahead, when no
    prefetcher thread would do it: the all-gather of ids then overlaps the
    step instead of adding its latency to it."""

    def __init__(self, source: Iterator[Batch], depth: int = 4) -> None:
        self.source = source
        self.window_used: list[int] = []
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recsys-plan", daemon=True)

    def __enter__(self) -> "PlanAhead":
        self._thread.start()
        return self

    def passed(self, step: int) -> None:
        """Planning fills no cache: nothing waits for the trainer."""

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch in self.source:
                if not self._put(batch):
                    return
            self._put(_DONE)
        except BaseException as e:  # surfaces in the trainer
            self._put(e)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30 if exc_type is None else 2)
        try:
            self.source.close()
        except ValueError:  # still running on a thread that did not stop
            pass


class CacheAvgPrefetcher(Prefetcher):
    """cache_avg's prefetcher. On rank 0 it fills the caches (CachedGroup.prepare)
    at most `window` batches ahead and broadcasts every fill; on the other ranks
    it receives the fills and copies them into the cache replica. SYNC markers
    travel in the batch stream and are handled by the trainer's thread."""

    thread_name = "recsys-cache-fill"

    def __init__(self, source: Iterator[Batch], groups: list[tuple[int, CachedGroup]], release, sync: EmbeddingSync,
                 start: int = 0, pause_at=None) -> None:
        super().__init__(source, groups, release, start, pause_at)
        self.sync = sync
        self.ctx = sync.ctx
        self.lead = self.ctx.is_main
        self._sends: list = []  # async SYNC broadcasts in flight (work, tensor)

    def __enter__(self) -> "CacheAvgPrefetcher":
        if self.lead:
            for g in self.groups:
                g.on_starved = self._starved_callback(g)
        return super().__enter__()

    def _prepare(self, group: CachedGroup, plan) -> None:
        (self._fill if self.lead else self._mirror)(group, plan)

    def _finish(self) -> None:
        self._wait_sends()

    def _marker(self, item) -> bool:
        if item is not _SYNC:
            return False
        self.sync.early_syncs += 1
        self.sync.sync_caches()
        return True

    def __exit__(self, exc_type, *exc) -> None:
        super().__exit__(exc_type, *exc)
        for g in self.groups:
            g.on_starved = None

    # --- rank 0 ---------------------------------------------------------------------
    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return broadcast_(tensor, 0, self.ctx.plan_group)

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _starved_callback(self, group: CachedGroup):
        def starved() -> None:
            """Called by prepare (lock held, every earlier batch completed) when
            only rows awaiting a sync could give room: ask every rank for one here."""
            self._queue.put(_SYNC)
            header = torch.tensor([SYNC, 0, 0, 0], dtype=torch.int64)
            # Asynchronous: never wait on a peer while holding the cache lock.
            self._sends.append((dist.broadcast(header, 0, group=self.ctx.plan_group, async_op=True), header))

        return starved

    def _fill(self, group: CachedGroup, plan) -> None:
        replica = self.sync.replicas[id(group)]
        with group.cond:  # only this thread loads or evicts, so this is what prepare will load
            missing = group.slot_of_row[plan.unique] < 0
        group.prepare(plan)
        self._wait_sends()
        if plan.ready is not None:
            plan.ready.synchronize()
        load = torch.nonzero(missing).flatten()
        header = torch.tensor([FILL, replica.syncs, plan.num_unique, load.numel()], dtype=torch.int64)
        self._bcast(header)
        self._bcast(torch.cat([plan.slots, load]))
        if load.numel():
            dev_slots = plan.slots[load].to(group.device)
            payload = torch.cat([group.cache_rows.index_select(0, dev_slots),
                                 group.cache_state.index_select(0, dev_slots)], 1).cpu()
            self._bcast(payload)

    # --- other ranks --------------------------------------------------------------------
    def _mirror(self, group: CachedGroup, plan) -> None:
        replica = self.sync.replicas[id(group)]
        while True:
            header = self._bcast(torch.zeros(4, dtype=torch.int64))
            if int(header[0]) == SYNC:
                self._queue.put(_SYNC)
                continue
            break
        syncs, n, n_load = (int(x) for x in header[1:])
        if n != plan.num_unique:
            raise RuntimeError(
                f"rank {self.ctx.rank} planned {plan.num_unique} rows of a batch but rank 0 filled {n}: "
                "the ranks disagree on the batch stream"
            )
        ints = self._bcast(torch.zeros(n + n_load, dtype=torch.int64))
        slots, load = ints[:n], ints[n:]
        payload = None
        if n_load:
            payload = self._bcast(torch.zeros(n_load, group.dim + group.cache_state.shape[1]))
        with group.cond:
            while replica.syncs < syncs:  # the slots rank 0 reused are free here only after that sync
                if self._stop.is_set() or group.stop.is_set():
                    raise PrefetchStopped()
                group.cond.wait(timeout=0.1)
            if n_load:
                target = slots[load]
                rows = plan.unique[load]
                previous = group.slot_of_row[rows].to(torch.int64)
                group.row_of_slot[previous[previous >= 0]] = -1
                old = group.row_of_slot[target]
                group.slot_of_row[old[old >= 0]] = -1
                dev = target.to(group.device)
                group.cache_rows.index_copy_(0, dev, payload[:, : group.dim].to(group.device))
                group.cache_state.index_copy_(0, dev, payload[:, group.dim :].to(group.device))
                group.row_of_slot[target] = rows
                group.slot_of_row[rows] = target.to(torch.int32)
                group.stats_["rows_loaded"] += n_load
            group.pins[slots] += 1
            group.inflight += 1
            group.stats_["hits"] += n - n_load
            group.stats_["misses"] += n_load
        plan.slots = slots
        plan.extras["slots_device"] = slots.to(group.device, non_blocking=True)

