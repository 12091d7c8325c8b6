"""EmbeddingBagCollection: every sparse feature's pooled embedding, in one module.

(Pooled, as TorchRec's EmbeddingBagCollection; TorchRec's EmbeddingCollection
is the unpooled, sequence one, which this project does not have.)

forward(batch) -> pooled [B, F, D] (sum pooling). Behind it, table groups
(tables.py, cache.py) hold the rows wherever the placement puts them. The
rows a batch needs are gathered once per unique row into a leaf tensor;
pooling runs with embedding_bag over that small tensor, so backward yields a
gradient for the batch's unique rows only (never a dense gradient over whole
tables), and step() hands it to each group's row optimizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recsys_cli.data.batch import Batch
from recsys_cli.data.jagged import KeyedJaggedTensor
from recsys_cli.embeddings.plan import LookupPlan, SegmentPlan, plan_lookup, segment_sum
from recsys_cli.embeddings.tables import TableGroup

class SumPool(torch.autograd.Function):
    """Sum pooling of rows[inverse] into bags, with a backward whose
    summation order depends only on the batch: every row's gradient adds its
    occurrences in batch order, as a segment sum over the plan's row_grad
    (sorted on the loader thread). embedding_bag's own backward sorts with an
    unstable sort on CPU and adds atomically on CUDA, so a row's gradient
    could change in the last bit with the size of its group or from run to
    run, and row-wise Adagrad amplifies that: exact placements need this
    order fixed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, row_grad: SegmentPlan):
        ctx.row_grad = row_grad
        return F.embedding_bag(inverse, rows, offsets, mode="sum")

    @staticmethod
    def backward(ctx, grad_pooled: torch.Tensor):
        return segment_sum(grad_pooled, ctx.row_grad), None, None, None


class ExpandBags(torch.autograd.Function):
    """pooled[bag_inverse]: unique bags out to every sample (dedup), with the
    same fixed-order backward (index_select's is an atomic index_add_ on CUDA)."""

    @staticmethod
    def forward(ctx, pooled: torch.Tensor, bag_inverse: torch.Tensor, bag_grad: SegmentPlan):
        ctx.bag_grad = bag_grad
        return pooled.index_select(0, bag_inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return segment_sum(grad, ctx.bag_grad), None, None


class EmbeddingBagCollection(nn.Module):
    def __init__(self, features: list[str], groups: list[tuple[list[str], TableGroup]], dim: int) -> None:
        """features: every sparse feature in batch key order; groups: (the
        group's features, group). Every feature is in exactly one group."""
        super().__init__()
        self.features = list(features)
        self.dim = dim
        self.groups = [g for _, g in groups]
        self.group_features = [list(fs) for fs, _ in groups]
        seen = [f for fs in self.group_features for f in fs]
        if sorted(seen) != sorted(self.features):
            raise ValueError(f"groups cover {sorted(seen)}, features are {sorted(self.features)}")
        self._key_index = {f: i for i, f in enumerate(self.features)}
        self._group_keys = [torch.tensor([self._key_index[f] for f in fs]) for fs in self.group_features]
        # Output order: pooled parts come out group by group; this puts them
        # back in feature order.
        order = [self._key_index[f] for fs in self.group_features for f in fs]
        self._identity_order = order == list(range(len(order)))
        self.register_buffer("_restore", torch.argsort(torch.tensor(order)), persistent=False)
        self._pending: list[tuple[TableGroup, LookupPlan, torch.Tensor]] = []
        self.shard_plan = None  # whole tables (ShardedEmbeddingBagCollection has its plan here)

    # --- planning: runs on the loader thread ------------------------------
    def plan_batch(self, batch: Batch) -> Batch:
        """Set the batch's plans (one LookupPlan per group) and id counts (a loader transform)."""
        sparse = batch.sparse
        if not isinstance(sparse, KeyedJaggedTensor):
            return self._plan_dedup(batch)
        if sparse.keys != self.features:
            raise ValueError(f"batch features {sparse.keys} differ from the model's {self.features}")
        num_keys, stride = len(sparse.keys), sparse.stride
        lengths = sparse.lengths.view(num_keys, stride)
        ids_per_key = lengths.sum(1)
        plans = []
        for keys, group in zip(self._group_keys, self.groups):
            if len(self.groups) == 1:
                values, group_lengths = sparse.values, sparse.lengths
            else:
                chunks = torch.split(sparse.values, ids_per_key.tolist())
                values = torch.cat([chunks[k] for k in keys.tolist()])
                group_lengths = lengths[keys].reshape(-1)
            plans.append(plan_lookup(values, group_lengths, ids_per_key[keys], group.feature_row_offset))
        batch.plans = plans
        batch.id_counts = self._id_counts(plans, ids_per_key, ids_per_key)
        return batch

    def _id_counts(self, plans, batch_ids: torch.Tensor, looked_up: torch.Tensor) -> torch.Tensor:
        """int64 [3, F] in feature order: ids in the batch, ids looked up
        (fewer with deduplicated bags), distinct rows. Counted on the loader
        thread, for the duplication statistics of the run."""
        distinct = torch.zeros(len(self.features), dtype=torch.int64)
        for keys, group, plan in zip(self._group_keys, self.groups, plans):
            feature_of_row = torch.searchsorted(group.feature_row_offset_sorted, plan.unique, right=True) - 1
            distinct[keys] += torch.bincount(group.feature_order[feature_of_row], minlength=len(keys))
        return torch.stack([batch_ids, looked_up, distinct])

    def _plan_dedup(self, batch: Batch) -> Batch:
        """Plans over the unique bags of an InverseKeyedJaggedTensor: pooling
        runs once per unique bag, bag_inverse expands it to every sample."""
        ikjt = batch.sparse
        if ikjt.keys != self.features:
            raise ValueError(f"batch features {ikjt.keys} differ from the model's {self.features}")
        bag_base = ikjt.bag_base()
        ids_per_key = torch.stack([ikjt.lengths[bag_base[k] : bag_base[k + 1]].sum() for k in range(len(ikjt.keys))])
        value_chunks = torch.split(ikjt.values, ids_per_key.tolist())
        plans = []
        for keys, group in zip(self._group_keys, self.groups):
            keys = keys.tolist()
            values = torch.cat([value_chunks[k] for k in keys])
            lengths = torch.cat([ikjt.lengths[bag_base[k] : bag_base[k + 1]] for k in keys])
            counts = torch.tensor([ikjt.unique_counts[k] for k in keys])
            first_bag = torch.cumsum(counts, 0) - counts  # the group's bags are numbered key by key
            bag_inverse = ikjt.inverse[keys] + first_bag.view(-1, 1)
            plans.append(plan_lookup(values, lengths, ids_per_key[keys], group.feature_row_offset, bag_inverse))
        batch.plans = plans
        batch_ids = ikjt.lengths[ikjt.global_inverse()].sum(1)
        batch.id_counts = self._id_counts(plans, batch_ids, ids_per_key)
        return batch

    # --- the step ----------------------------------------------------------
    def prepare(self, batch: Batch) -> None:
        """Make resident the rows of groups no prefetcher prepared (on-demand
        caches fill here, on the trainer's thread; other groups do nothing)."""
        for group, plan in zip(self.groups, batch.plans):
            if not group.lookahead and plan.slots is None:
                group.prepare(plan)

    def forward(self, batch: Batch) -> torch.Tensor:
        plans: list[LookupPlan] = batch.plans or self.plan_batch(batch).plans
        return self.pool(plans, batch.size)

    def pool(self, plans: list[LookupPlan], stride: int) -> torch.Tensor:
        """Pooled [stride, F, D] of the plans' bags (a sharded run's owner pools
        the bags routed to it, every rank's slice: sharded.py)."""
        record = torch.is_grad_enabled()
        parts = []
        for group, plan in zip(self.groups, plans):
            if record:
                rows = group.gather(plan).requires_grad_()
                self._pending.append((group, plan, rows))
            else:
                rows = plan.rows  # read by another rank (distributed cache_avg evaluation)
                if rows is None:
                    rows = group.read_as_saved(plan.unique)
            pooled = SumPool.apply(rows, plan.inverse, plan.offsets, plan.row_grad)
            if plan.bag_inverse is not None:
                pooled = ExpandBags.apply(pooled, plan.bag_inverse.reshape(-1), plan.bag_grad)
            parts.append(pooled.view(plan.num_features, stride, self.dim))
        pooled = parts[0] if len(parts) == 1 else torch.cat(parts)
        if not self._identity_order:
            pooled = pooled.index_select(0, self._restore)
        return pooled.transpose(0, 1)  # [B, F, D]

    def pending(self) -> list[tuple[TableGroup, LookupPlan, torch.Tensor]]:
        """(group, plan, gathered rows) of the last forward, until step(): the
        distributed trainer averages the rows' gradients across ranks here."""
        return self._pending

    @torch.no_grad()
    def step(self) -> None:
        """Apply the row optimizer to every row the last forward gathered."""
        for group, plan, rows in self._pending:
            if rows.grad is not None:
                group.update(plan, rows.detach(), rows.grad)
        self._pending.clear()

    def release(self, batch: Batch) -> None:
        for group, plan in zip(self.groups, batch.plans or ()):
            group.release(plan)

    def cache_sizes(self) -> list[str]:
        """One start-up line per cached group: its tables, slots and why that many."""
        lines = []
        for fs, g in zip(self.group_features, self.groups):
            if getattr(g, "sizing", None) is not None and hasattr(g, "capacity"):
                tables = fs[0] if len(fs) == 1 else f"{len(fs)} tables ({fs[0]}..{fs[-1]})"
                kind = "on-demand" if g.kind == "cache" else g.kind  # placement=cache: not "cache cache of"
                lines.append(f"{kind} cache of {tables}: {g.capacity:,} slots ({g.sizing})")
        return lines

    # --- whole tables --------------------------------------------------------
    def table_state(self, patch_beside: bool = False) -> dict[str, dict]:
        """Every group's tables (TableGroup.table_state); patch_beside: a
        checkpoint's form, the cache's dirty rows beside the tables, not copied in."""
        out: dict[str, dict] = {}
        for g in self.groups:
            out.update(g.table_state(patch_beside))
        return out

    def load_table_state(self, tables: dict[str, dict]) -> None:
        for g in self.groups:
            g.load_table_state(tables)

    def cache_snapshot(self) -> list[dict | None]:
        """Per group, what resumes its cache exactly (None for uncached groups)."""
        return [g.cache_snapshot() for g in self.groups]

    def tables_with_restored_caches(self, saved: list | None) -> set[str]:
        """The tables whose cache load_cache_snapshot(saved) restores exactly."""
        saved = saved if saved is not None and len(saved) == len(self.groups) else [None] * len(self.groups)
        return {t.name for g, s in zip(self.groups, saved)
                if g.restores_cache(s) for t in g.tables}

    def load_cache_snapshot(self, saved: list | None, step: int) -> None:
        """After load_table_state: restore caches saved by the same placement;
        others start empty at batch `step`."""
        saved = saved if saved is not None and len(saved) == len(self.groups) else [None] * len(self.groups)
        for g, s in zip(self.groups, saved):
            g.load_cache_snapshot(s, step)

    def memory(self) -> dict[str, int]:
        """Bytes allocated by tier (device, host, disk) and by what they hold:
        tables (rows in their precision plus optimizer state), fp32 cache
        slots, and the cache's index (row-to-slot map, pins, victim scores)."""
        total = {"device": 0, "host": 0, "disk": 0, "table": 0, "cache": 0, "index": 0}
        for g in self.groups:
            for tier, kind, n in g.memory():
                total[tier] += n
                total[kind] += n
        return total

    def runtimes(self) -> list:
        """The device runtimes the groups copy through (their copy counts: device.sum_copies)."""
        return [g.runtime for g in self.groups if getattr(g, "runtime", None) is not None]

    def host_pin(self):
        """What pins host tensors the device will read (CUDA), or None (CPU)."""
        pinning = [r for r in self.runtimes() if r.pins_host]
        return pinning[0].pin if pinning else None

    def stats(self) -> dict:
        merged: dict = {}
        for g in self.groups:
            for k, v in g.stats().items():
                if isinstance(v, (int, float)):
                    merged[k] = merged.get(k, 0) + v
        if "hits" in merged:
            total = merged["hits"] + merged["misses"]
            merged["hit_rate"] = merged["hits"] / total if total else None
        if "disk_bytes_needed" in merged:  # the disk tier (disk_store.py)
            needed = merged["disk_bytes_needed"]
            merged["disk_read_amplification"] = merged["disk_bytes_read"] / needed if needed else None
            host = merged["host_cache_hits"] + merged["host_cache_misses"]
            merged["host_cache_hit_rate"] = merged["host_cache_hits"] / host if host else None
        return merged
