"""Sharding: which rank owns which rows of which table (TorchRec's sharding types).

`placement.sharding` decides, for a run of N processes:

  replicated  every rank holds every table (the default; trainer.embedding_sync
              keeps the replicas in step)
  table       each table whole on one rank (TorchRec's table-wise): tables
              are packed largest first onto the rank with the fewest bytes,
              then the fewest expected lookups
  row         every table split in N contiguous row ranges, one per rank
              (row-wise): for tables too large for one rank
  auto        the planner picks table- or row-wise per table (plan_auto)

A ShardPlan lists the shards: (table, rank, rows [lo, hi)). A shard is a
table of its own to the rank that owns it (TableSpec with row_base), built,
placed, cached and checkpointed like any table, so every placement and
precision composes with sharding. Each row has exactly one owner
(DESIGN's invariant): nothing of a sharded table is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recsys_cli.errors import UserError

SHARDINGS = ("replicated", "table", "row", "auto")


@dataclass(frozen=True)
class Shard:
    table: str
    rank: int
    lo: int  # rows [lo, hi) of the table
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass
class ShardPlan:
    kind: str  # table | row | auto
    world_size: int
    shards: list[Shard]  # table by table (in feature order), a table's shards in row order
    table_rows: dict[str, int]
    row_bytes: dict[str, int]  # per table: bytes of one row where it lives, optimizer state included
    lookups: dict[str, float] = field(default_factory=dict)  # per table: expected ids per step (global batch)

    def shards_of(self, table: str) -> list[Shard]:
        return [s for s in self.shards if s.table == table]

    def owned(self, rank: int) -> list[Shard]:
        """The shards `rank` holds, in plan order."""
        return [s for s in self.shards if s.rank == rank]

    def rank_bytes(self) -> list[int]:
        out = [0] * self.world_size
        for s in self.shards:
            out[s.rank] += s.rows * self.row_bytes[s.table]
        return out

    def rank_lookups(self) -> list[float]:
        """Expected lookups per step a rank serves (a row-wise shard: its share of the table's rows)."""
        out = [0.0] * self.world_size
        for s in self.shards:
            out[s.rank] += self.lookups.get(s.table, 0.0) * s.rows / self.table_rows[s.table]
        return out

    def imbalance(self) -> float:
        """The largest rank's bytes over the mean (1.0: perfectly even)."""
        per_rank = self.rank_bytes()
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean else 1.0

    def to_dict(self) -> dict:
        """summary.json's "sharding" entry."""
        return {
            "kind": self.kind, "world_size": self.world_size,
            "shards": [{"table": s.table, "rank": s.rank, "rows": [s.lo, s.hi]} for s in self.shards],
            "rank_bytes": self.rank_bytes(), "rank_lookups": self.rank_lookups(), "imbalance": self.imbalance(),
        }


def row_ranges(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """N contiguous ranges covering [0, num_rows), sizes differing by at most one row."""
    base, extra = divmod(num_rows, world_size)
    out, lo = [], 0
    for r in range(world_size):
        hi = lo + base + (r < extra)
        out.append((lo, hi))
        lo = hi
    return out


def plan_table_wise(tables: list[tuple[str, int]], row_bytes: dict[str, int], world_size: int,
                    lookups: dict[str, float] | None = None, kind: str = "table") -> ShardPlan:
    """Each table on one rank: largest first onto the rank with the fewest
    bytes so far, ties by fewest lookups, then lowest rank (deterministic)."""
    lookups = lookups or {}
    load = [(0, 0.0)] * world_size
    owner: dict[str, int] = {}
    for name, rows in sorted(tables, key=lambda t: (-t[1] * row_bytes[t[0]], t[0])):
        rank = min(range(world_size), key=lambda r: (load[r][0], load[r][1], r))
        owner[name] = rank
        load[rank] = (load[rank][0] + rows * row_bytes[name], load[rank][1] + lookups.get(name, 0.0))
    shards = [Shard(name, owner[name], 0, rows) for name, rows in tables]
    return ShardPlan(kind, world_size, shards, dict(tables), dict(row_bytes), dict(lookups))


def plan_row_wise(tables: list[tuple[str, int]], row_bytes: dict[str, int], world_size: int,
                  lookups: dict[str, float] | None = None) -> ShardPlan:
    """Every table in N contiguous row ranges, range r on rank r (a table of
    fewer rows than ranks has no shard on the last ranks)."""
    shards = [Shard(name, r, lo, hi) for name, rows in tables
              for r, (lo, hi) in enumerate(row_ranges(rows, world_size)) if hi > lo]
    return ShardPlan("row", world_size, shards, dict(tables), dict(row_bytes), dict(lookups or {}))


def plan_shards(kind: str, tables: list[tuple[str, int]], row_bytes: dict[str, int], world_size: int,
                lookups: dict[str, float] | None = None) -> ShardPlan:
    if kind == "table":
        return plan_table_wise(tables, row_bytes, world_size, lookups)
    if kind == "row":
        return plan_row_wise(tables, row_bytes, world_size, lookups)
    raise UserError(f"placement.sharding={kind!r} is not one of {', '.join(SHARDINGS)}")
