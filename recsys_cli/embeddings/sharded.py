"""ShardedEmbeddingBagCollection: every rank owns some rows, ids go to their owners.

Data parallel outside, model parallel inside (TorchRec's sharded
EmbeddingBagCollection). Each rank reads its own slice of the global batch;
the tables are split into shards (sharding.py), each held by one rank in a
local EmbeddingBagCollection of its own, with any placement and precision.
A batch goes through three steps:

  plan_batch  (loader thread) cut this rank's ids by destination: for every
              shard of every rank, the slice's bags of that shard's table
              (a row-wise shard: the ids in its row range, rebased to it)
  route       (the thread that plans ahead; main thread for evaluation) one
              all-to-all of the ids: each owner receives its tables' bags for
              every rank's slice, concatenated in rank order -- the bags of
              the global batch -- and plans them with its local collection
              (unique rows, the fixed-order gradient plans), so its caches
              and lookahead see exactly the ids routed to it
  forward     (trainer) the owner pools the global batch's bags of its
              shards; one all-to-all of pooled rows sends each rank its
              slice (PooledExchange); a row-wise table's partial sums are
              added in rank order. Backward sends the pooled gradients the
              other way, and the owner's row optimizer updates its rows.

A row's gradient is the segment sum, in global batch order, of the pooled
gradients of the bags that use it: what one process computes on the whole
batch, so an owner updates its rows as one process would from the same
pooled gradients. One owner per row: nothing of a sharded table is
replicated, and no cache broadcast or averaging is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from recsys_cli.data.batch import Batch
from recsys_cli.data.dedup import InverseKeyedJaggedTensor, dedup_kjt
from recsys_cli.data.jagged import KeyedJaggedTensor
from recsys_cli.embeddings.collection import EmbeddingBagCollection
from recsys_cli.embeddings.plan import Route
from recsys_cli.embeddings.plan import LookupPlan
from recsys_cli.embeddings.sharding import Shard, ShardPlan
from recsys_cli.errors import UserError


class PooledExchange(torch.autograd.Function):
    """Owner's pooled [B_global, S, D] -> this rank's [B, V, D]: V columns,
    rank by rank the shards each rank owns. Backward returns the gradients
    to their owners, divided by the world size: a rank's loss is scaled to
    its share of N times the global mean (strategies' loss_scale), as the
    dense all-reduce averages over N."""

    @staticmethod
    def forward(ctx, owner: torch.Tensor, batch_sizes: list[int], shards_per_rank: list[int], rank: int, group):
        ctx.batch_sizes, ctx.shards_per_rank, ctx.rank, ctx.group = batch_sizes, shards_per_rank, rank, group
        dim = owner.shape[2]
        ctx.dim = dim
        mine = batch_sizes[rank]
        send = owner.contiguous().view(-1)  # rank r's slice is rows [offset_r, offset_r + B_r): contiguous
        send_splits = [b * owner.shape[1] * dim for b in batch_sizes]
        recv_splits = [mine * s * dim for s in shards_per_rank]
        received = _all_to_all(send, send_splits, recv_splits, group)
        parts = [p.view(mine, s, dim) for p, s in zip(torch.split(received, recv_splits), shards_per_rank)]
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        batch_sizes, shards_per_rank, dim = ctx.batch_sizes, ctx.shards_per_rank, ctx.dim
        mine, owned = batch_sizes[ctx.rank], shards_per_rank[ctx.rank]
        parts = torch.split(grad, shards_per_rank, 1)
        send = torch.cat([p.contiguous().view(-1) for p in parts])
        send_splits = [mine * s * dim for s in shards_per_rank]
        recv_splits = [b * owned * dim for b in batch_sizes]
        received = _all_to_all(send, send_splits, recv_splits, ctx.group)
        owner_grad = received.view(sum(batch_sizes), owned, dim)
        return owner_grad / len(batch_sizes), None, None, None, None


def _all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """One all_to_all_single of `send` (dim 0 split as given), on the group's device."""
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    out = torch.empty(sum(recv_splits), dtype=send.dtype, device=device)
    try:
        dist.all_to_all_single(out, send.to(device), recv_splits, send_splits, group=group)
    except (RuntimeError, NotImplementedError) as e:
        if "not supported" in str(e).lower() or "not implemented" in str(e).lower() or isinstance(e, NotImplementedError):
            raise UserError(f"placement.sharding routes ids by all_to_all, which the {backend} backend lacks "
                            f"({str(e).splitlines()[0]}); use gloo (CPU) or nccl (CUDA), or placement.sharding="
                            "replicated") from None
        raise
    return out.to(send.device)


class ShardedEmbeddingBagCollection(nn.Module):
    """Pooled embeddings [B, F, D] of this rank's slice, from tables sharded
    over the ranks. `local` holds this rank's shards (one table each, named
    after its table); groups, caches, checkpoints and statistics are its."""

    def __init__(self, features: list[str], dim: int, plan: ShardPlan, rank: int,
                 local: EmbeddingBagCollection | None, group, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.features, self.dim, self.plan, self.rank, self.group = list(features), dim, plan, rank, group
        # where the pooled rows go (the dense model's device), also on a rank that owns no shard
        self.device = torch.device(device)
        self.shard_plan: ShardPlan | None = plan
        self.world_size = plan.world_size
        self.local = local
        self.groups = local.groups if local is not None else []
        self.owned: list[list[Shard]] = [plan.owned(r) for r in range(self.world_size)]
        if local is not None and local.features != [s.table for s in self.owned[rank]]:
            raise ValueError(f"local tables {local.features} differ from the plan's {[s.table for s in self.owned[rank]]}")
        self._key_index = {f: i for i, f in enumerate(self.features)}
        # The received columns, rank by rank: which feature each one is; a feature's
        # first column is copied, its later ones (row-wise partial sums) added in rank order.
        columns = [self._key_index[s.table] for shards in self.owned for s in shards]
        self._first = torch.tensor([columns.index(f) for f in range(len(self.features))])
        later: list[list[tuple[int, int]]] = []  # later[k]: (feature, column) of every feature's (k+1)-th column
        seen = [0] * len(self.features)
        for c, f in enumerate(columns):
            if seen[f]:
                while len(later) < seen[f]:
                    later.append([])
                later[seen[f] - 1].append((f, c))
            seen[f] += 1
        if min(seen, default=1) < 1:
            raise ValueError("the shard plan leaves a feature without an owner")
        self._later = [(torch.tensor([f for f, _ in k]), torch.tensor([c for _, c in k])) for k in later]
        self._columns_device: tuple | None = None  # (device, first, later) on the pooled rows' device
        # Cutting ids by shard in a few whole-batch ops (plan_batch): shards numbered rank by rank
        # ("slots", the order of the payloads), found by their first row in a fused row space.
        slots = [s for shards in self.owned for s in shards]
        base = torch.cumsum(torch.tensor([0] + [plan.table_rows[f] for f in self.features]), 0)
        self._feature_base = base[:-1]
        first = torch.tensor([int(base[self._key_index[s.table]]) + s.lo for s in slots])
        self._slot_order = torch.argsort(first)
        self._slot_first = first[self._slot_order]
        self._slot_lo = torch.tensor([s.lo for s in slots])
        self._slot_range = torch.cumsum(torch.tensor([0] + [len(shards) for shards in self.owned]), 0).tolist()
        # What this rank sent by all-to-all in training steps (evaluation not counted):
        # ids and bag lengths to the owners, pooled rows to every rank, and (backward) their gradients back.
        self.train_steps, self.ids_bytes_sent, self.pooled_bytes_sent = 0, 0, 0

    # --- the loader thread ---------------------------------------------------------
    def plan_batch(self, batch: Batch) -> Batch:
        """Cut the slice's ids by destination (a loader transform)."""
        deduplicated = isinstance(batch.sparse, InverseKeyedJaggedTensor)
        # Deduplicated bags travel expanded; each owner deduplicates the global batch's bags (route).
        sparse = batch.sparse.to_kjt() if isinstance(batch.sparse, InverseKeyedJaggedTensor) else batch.sparse
        if sparse.keys != self.features:
            raise ValueError(f"batch features {sparse.keys} differ from the model's {self.features}")
        stride, values = sparse.stride, sparse.values
        lengths = sparse.lengths.view(len(self.features), stride)
        # Every id's shard ("slot") and its row in it; then the ids grouped by slot,
        # each slot's in batch order (a stable sort), and per slot and bag how many.
        key = torch.repeat_interleave(torch.arange(len(self.features)), lengths.sum(1))
        found = self._slot_order[torch.searchsorted(self._slot_first, values + self._feature_base[key], right=True) - 1]
        order = torch.argsort(found, stable=True)
        ids = (values - self._slot_lo[found])[order]
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.reshape(-1)) % stride
        slots = self._slot_lo.numel()
        per_bag = torch.bincount(found * stride + bag, minlength=slots * stride).view(slots, stride)
        id_ends = torch.cumsum(torch.bincount(found, minlength=slots), 0).tolist()
        payloads, num_ids = [], []
        for a, b in zip(self._slot_range[:-1], self._slot_range[1:]):
            lo, hi = id_ends[a - 1] if a else 0, id_ends[b - 1] if b else 0
            payloads.append(torch.cat([per_bag[a:b].reshape(-1), ids[lo:hi]]))
            num_ids.append(hi - lo)
        sent = sum(p.numel() for r, p in enumerate(payloads) if r != self.rank) * 8
        batch.route = Route(payloads, num_ids, bytes_sent=sent, deduplicated=deduplicated)
        batch.plans = None
        return batch

    # --- the routing thread ----------------------------------------------------------
    def route(self, batch: Batch, group) -> Batch:
        """Exchange the ids (two all-to-alls on `group`: sizes, then ids) and
        plan the routed bags: batch.plans become the owner's plans over every
        rank's slice, batch.id_counts this rank's tables' counts."""
        route = batch.route
        if route is None:
            raise ValueError("a sharded batch must be cut by plan_batch before it is routed")
        world, mine = self.world_size, batch.size
        header = torch.tensor([[mine, n] for n in route.num_ids], dtype=torch.int64).view(-1)
        sizes = _all_to_all(header, [2] * world, [2] * world, group).view(world, 2)
        batch_sizes = sizes[:, 0].tolist()
        owned = self.owned[self.rank]
        recv_splits = [len(owned) * b + n for b, n in sizes.tolist()]
        received = _all_to_all(torch.cat(route.payloads), [p.numel() for p in route.payloads], recv_splits, group)
        route.batch_sizes = batch_sizes
        if self.local is None:
            batch.plans, batch.id_counts = [], torch.zeros(3, len(self.features), dtype=torch.int64)
            return batch
        lengths_by_rank, ids_by_rank = [], []
        for part, b in zip(torch.split(received, recv_splits), batch_sizes):
            lens = part[: len(owned) * b].view(len(owned), b)
            lengths_by_rank.append(lens)
            ids_by_rank.append(torch.split(part[len(owned) * b :], lens.sum(1).tolist()))
        values = torch.cat([ids[k] for k in range(len(owned)) for ids in ids_by_rank])
        lengths = torch.cat([lens[k] for k in range(len(owned)) for lens in lengths_by_rank])
        routed = KeyedJaggedTensor([s.table for s in owned], values, lengths, sum(batch_sizes))
        # With dedup, pooled once per distinct bag of the global batch (bags repeated across ranks too).
        sparse = dedup_kjt(routed) if route.deduplicated else routed
        planned = self.local.plan_batch(Batch(torch.empty(0), sparse, torch.empty(sum(batch_sizes))))
        batch.plans = planned.plans
        counts = torch.zeros(3, len(self.features), dtype=torch.int64)  # the owner counts its tables' ids
        if planned.id_counts is not None:
            counts.index_add_(1, torch.tensor([self._key_index[s.table] for s in owned]), planned.id_counts)
        batch.id_counts = counts
        return batch

    # --- the step ----------------------------------------------------------------------
    def prepare(self, batch: Batch) -> None:
        if self.local is not None:
            self.local.prepare(batch)

    def forward(self, batch: Batch) -> torch.Tensor:
        route = batch.route
        if route is None or route.batch_sizes is None or batch.plans is None:
            raise ValueError("a sharded batch is routed before its forward (ShardedEmbeddingBagCollection.route)")
        total = sum(route.batch_sizes)
        if self.local is not None:
            owner = self.local.pool(batch.plans, total)
        else:
            owner = torch.zeros(total, 0, self.dim, device=self.device, requires_grad=torch.is_grad_enabled())
        received = PooledExchange.apply(owner, route.batch_sizes, [len(s) for s in self.owned], self.rank, self.group)
        if torch.is_grad_enabled():  # a training step: the gradients go back the same way
            mine = route.batch_sizes[self.rank] * owner.shape[1] * self.dim * owner.element_size()
            self.train_steps += 1
            self.ids_bytes_sent += route.bytes_sent
            self.pooled_bytes_sent += owner.numel() * owner.element_size() - mine  # rows for the other ranks
        first, later = self._columns_on(received.device)
        pooled = received.index_select(1, first)
        for features, columns in later:  # row-wise partial sums, in rank order
            pooled = pooled.index_add(1, features, received.index_select(1, columns))
        return pooled

    def _columns_on(self, device: torch.device):
        """The received columns' index tensors where the pooled rows are: copied
        once, not every step (a pageable copy to a GPU waits for it)."""
        if self._columns_device is None or self._columns_device[0] != device:
            move = lambda t: t.to(device)  # noqa: E731
            self._columns_device = (device, move(self._first), [(move(f), move(c)) for f, c in self._later])
        return self._columns_device[1], self._columns_device[2]

    def exchange_report(self) -> dict[str, float]:
        """Bytes this rank sent to the others per training step, by what they carried."""
        steps = max(self.train_steps, 1)
        return {"ids_bytes_per_step": self.ids_bytes_sent / steps,
                "pooled_bytes_per_step": self.pooled_bytes_sent / steps,  # forward; backward sends as many
                "all_to_all_bytes_per_step": (self.ids_bytes_sent + 2 * self.pooled_bytes_sent) / steps}

    def pending(self):
        return self.local.pending() if self.local is not None else []

    @torch.no_grad()
    def step(self) -> None:
        if self.local is not None:
            self.local.step()

    def release(self, batch: Batch) -> None:
        if self.local is not None:
            self.local.release(batch)

    def cache_sizes(self) -> list[str]:
        return self.local.cache_sizes() if self.local is not None else []

    # --- this rank's shards, whole ------------------------------------------------------
    def table_state(self, patch_beside: bool = False) -> dict[str, dict]:
        """This rank's shards, by table name (rows of the shard only)."""
        return self.local.table_state(patch_beside) if self.local is not None else {}

    def load_table_state(self, tables: dict[str, dict]) -> None:
        if self.local is not None:
            self.local.load_table_state(tables)

    def cache_snapshot(self) -> list:
        return self.local.cache_snapshot() if self.local is not None else []

    def tables_with_restored_caches(self, saved: list | None) -> set[str]:
        return self.local.tables_with_restored_caches(saved) if self.local is not None else set()

    def load_cache_snapshot(self, saved: list | None, step: int) -> None:
        if self.local is not None:
            self.local.load_cache_snapshot(saved, step)

    def memory(self) -> dict[str, int]:
        if self.local is not None:
            return self.local.memory()
        return {"device": 0, "host": 0, "disk": 0, "table": 0, "cache": 0, "index": 0}

    def runtimes(self) -> list:
        return self.local.runtimes() if self.local is not None else []

    def host_pin(self):
        return self.local.host_pin() if self.local is not None else None

    def stats(self) -> dict:
        return self.local.stats() if self.local is not None else {}




def build_sharded_embeddings(features: list[str], vocab_sizes: list[int], dim: int, placement, precision, optimizer,
                             device, seed: int, rank: int, world_size: int, group,
                             batch_ids: dict[str, int | None] | None = None,
                             lookups: dict[str, float] | None = None) -> ShardedEmbeddingBagCollection:
    """This rank's shards of placement.sharding's plan, each built as a table
    of its own with the configured placement and precision (build_embeddings),
    starting from the same rows as the whole table's (TableSpec.first_row).
    lookups: per table the ids a global batch looks up (the planner's second
    objective; default: batch_ids, a one-hot table's ids per batch)."""
    from recsys_cli.embeddings.placement import build_embeddings
    from recsys_cli.embeddings.placement_bytes import parse_bytes
    from recsys_cli.embeddings.sharding import plan_shards, shard_row_bytes
    from recsys_cli.embeddings.table_init import TableSpec

    state = 1 if optimizer.has_state else 0
    tables = list(zip(features, vocab_sizes))
    row_bytes = {f: shard_row_bytes(dim, precision.kind, state) for f in features}
    if lookups is None:
        lookups = {f: float(n) for f, n in (batch_ids or {}).items() if n is not None}
    plan = plan_shards(str(placement.sharding), tables, row_bytes, world_size, lookups)
    if placement.device_memory_budget:  # with sharding: what each rank's shards may take
        budget = parse_bytes(placement.device_memory_budget, "placement.device_memory_budget")
        per_rank = plan.rank_bytes()
        worst = max(range(world_size), key=lambda r: per_rank[r])
        if per_rank[worst] > budget:
            raise UserError(
                f"placement.sharding={plan.kind}: rank {worst} of {world_size} would hold {per_rank[worst] / 2**20:,.1f} "
                f"MiB of tables, over placement.device_memory_budget={placement.device_memory_budget}: train on more "
                "processes (trainer.nproc), in a lower precision, or with sharding=row or auto")
    owned = plan.owned(rank)
    local = None
    if owned:
        specs = [TableSpec(s.table, s.rows, dim, s.lo, plan.table_rows[s.table]) for s in owned]
        local = build_embeddings([s.table for s in owned], [s.rows for s in owned], dim, placement, precision,
                                 optimizer, device, seed, batch_ids=batch_ids, shards=specs,
                                 table_numbers={f: i for i, f in enumerate(features)})
    return ShardedEmbeddingBagCollection(features, dim, plan, rank, local, group, device)
