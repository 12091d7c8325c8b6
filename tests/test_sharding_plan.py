"""The shard planner (embeddings/sharding.py): table-wise, row-wise and auto
plans, their start-up table and summary.json form. Pure functions: no
processes, no tables built."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from data_tools.synthetic import KAGGLE_CARDINALITIES
from recsys_cli.embeddings.placement_bytes import device_row_bytes, host_row_bytes
from recsys_cli.embeddings.sharding import (
    AUTO_GOAL,
    Shard,
    ShardPlan,
    plan_auto,
    plan_row_wise,
    plan_shards,
    plan_table_wise,
    row_ranges,
    shard_row_bytes,
)
from recsys_cli.errors import UserError

KAGGLE = [(f"C{i + 1}", n) for i, n in enumerate(KAGGLE_CARDINALITIES)]  # 33.8M rows
BATCH = 4096.0  # one id per sample and table (Criteo is single-hot): expected lookups per step


def row_bytes_of(tables, dim=16, precision="fp32", state=0) -> dict[str, int]:
    return {name: shard_row_bytes(dim, precision, state) for name, _ in tables}


def lookups_of(tables) -> dict[str, float]:
    return {name: BATCH for name, _ in tables}


def assert_one_owner_per_row(plan: ShardPlan, tables) -> None:
    """Every table's shards cover its rows exactly once, in contiguous ranges, each on a valid rank."""
    assert [s.table for s in plan.shards] == sorted((s.table for s in plan.shards),
                                                    key=[n for n, _ in tables].index)  # feature order
    for name, rows in tables:
        shards = plan.shards_of(name)
        assert shards and shards[0].lo == 0 and shards[-1].hi == rows, name
        for a, b in zip(shards, shards[1:]):
            assert a.hi == b.lo, (name, a, b)
        assert all(0 <= s.rank < plan.world_size and s.lo <= s.hi for s in shards)
    assert sum(plan.rank_bytes()) == sum(rows * plan.row_bytes[n] for n, rows in tables)


def whole_tables(plan: ShardPlan) -> set[str]:
    return {s.table for s in plan.shards if (s.lo, s.hi) == (0, plan.table_rows[s.table])}


def test_shard_row_bytes_are_placement_searchs_row_sizes():
    assert shard_row_bytes(16, "fp32", 0) == device_row_bytes(16) == host_row_bytes(16, "fp32") == 64
    assert shard_row_bytes(16, "fp32", 1) == device_row_bytes(16, 1) == 68  # row-wise Adagrad's accumulator
    for precision in ("fp16", "int8", "int4"):
        assert shard_row_bytes(16, precision, 1) == host_row_bytes(16, precision, 1)
    assert shard_row_bytes(16, "int8", 1) == 16 + 4 + 4
    with pytest.raises(UserError, match="precision.kind"):
        shard_row_bytes(16, "int2", 0)


def test_table_wise_packing_is_deterministic_and_every_table_has_one_owner():
    rb = row_bytes_of(KAGGLE)
    plan = plan_table_wise(KAGGLE, rb, 3, lookups_of(KAGGLE))
    assert_one_owner_per_row(plan, KAGGLE)
    assert len(plan.shards) == len(KAGGLE) and whole_tables(plan) == {n for n, _ in KAGGLE}
    again = plan_table_wise(KAGGLE, rb, 3, lookups_of(KAGGLE))
    assert again.shards == plan.shards
    # the owners follow from the tables, not from the order they are listed in
    shuffled = plan_table_wise(KAGGLE[::-1], rb, 3, lookups_of(KAGGLE))
    assert {s.table: s.rank for s in shuffled.shards} == {s.table: s.rank for s in plan.shards}
    # largest first onto the lightest rank: the three largest tables on three different ranks
    largest = sorted(KAGGLE, key=lambda t: -t[1])[:3]
    assert sorted(plan.shards_of(name)[0].rank for name, _ in largest) == [0, 1, 2]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_row_wise_ranges_cover_each_table_once_contiguously(world_size):
    tables = [("big", 1001), ("tiny", 3), ("one", 1), *KAGGLE[:4]]
    plan = plan_row_wise(tables, row_bytes_of(tables), world_size)
    assert_one_owner_per_row(plan, tables)
    for name, rows in tables:
        shards = plan.shards_of(name)
        assert [s.rank for s in shards] == list(range(min(rows, world_size)))  # range r on rank r, none empty
        assert max(s.rows for s in shards) - min(s.rows for s in shards) <= 1
    assert row_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("precision,state", [("fp32", 0), ("int8", 1)])
def test_auto_on_the_kaggle_tables_keeps_the_largest_rank_within_the_goal(world_size, precision, state):
    rb = row_bytes_of(KAGGLE, 16, precision, state)
    plan = plan_shards("auto", KAGGLE, rb, world_size, lookups_of(KAGGLE))
    assert plan.kind == "auto"
    assert_one_owner_per_row(plan, KAGGLE)
    # the planner goal is 1.1x; AUTO_GOAL aims at 1.02x (a rank's memory goal needs it at N=2)
    assert AUTO_GOAL == 1.02 and plan.imbalance() <= 1.05, plan.rank_bytes()
    assert max(plan.rank_bytes()) <= max(plan_table_wise(KAGGLE, rb, world_size).rank_bytes())
    # small tables stay whole: every table under 0.3 % of the bytes is table-wise (at N=8
    # reaching 1.02x splits C24 and C26, 0.8 % and 0.4 %), and
    # the row-wise ones are the largest tables
    total = sum(plan.rank_bytes())
    whole = whole_tables(plan)
    assert {n for n, rows in KAGGLE if rows * rb[n] < total * 0.003} <= whole
    split = [n for n, _ in sorted(KAGGLE, key=lambda t: -t[1]) if n not in whole]
    assert split == [n for n, _ in sorted(KAGGLE, key=lambda t: -t[1])][:len(split)]
    assert set(plan.reasons) == set(split)  # why_lines says why each one is split
    assert plan_shards("auto", KAGGLE, rb, world_size, lookups_of(KAGGLE)) == plan  # deterministic


def test_auto_splits_only_what_the_goal_needs_on_the_kaggle_tables():
    rb = row_bytes_of(KAGGLE)
    two = plan_auto(KAGGLE, rb, 2, lookups_of(KAGGLE))
    assert plan_table_wise(KAGGLE, rb, 2).imbalance() > AUTO_GOAL  # table-wise alone: 1.04x at N=2
    assert two.imbalance() <= AUTO_GOAL
    assert whole_tables(two) == {n for n, _ in KAGGLE} - {"C3", "C12"}  # the two largest tables split, no more
    four = plan_auto(KAGGLE, rb, 4, lookups_of(KAGGLE))
    assert "C3" not in whole_tables(four)  # 10.1M rows: more than a quarter of the 33.8M
    assert "C3" in four.reasons and "more than the mean rank's" in four.reasons["C3"]
    assert plan_table_wise(KAGGLE, rb, 4).imbalance() > AUTO_GOAL  # what auto is for
    one = plan_auto(KAGGLE, rb, 1, lookups_of(KAGGLE))
    assert {s.rank for s in one.shards} == {0} and whole_tables(one) == {n for n, _ in KAGGLE}


def test_auto_then_lookups_no_whole_table_move_helps_the_busiest_rank_without_costing_bytes():
    """The second objective: from the busiest rank in lookups, no whole table
    can go to another rank below its lookups without a rank passing the largest rank's bytes."""
    rb = row_bytes_of(KAGGLE)
    for world_size in (3, 4):
        plan = plan_auto(KAGGLE, rb, world_size, lookups_of(KAGGLE))
        per_bytes, per_lookups = plan.rank_bytes(), plan.rank_lookups()
        busiest = max(range(world_size), key=lambda r: per_lookups[r])
        for s in plan.owned(busiest):
            if s.table not in whole_tables(plan):
                continue
            for dst in set(range(world_size)) - {busiest}:
                fits = per_bytes[dst] + s.rows * rb[s.table] <= max(per_bytes)
                assert not (fits and per_lookups[dst] + BATCH < per_lookups[busiest]), (s, dst)
        table_wise = plan_table_wise(KAGGLE, rb, world_size, lookups_of(KAGGLE))
        assert max(per_lookups) < max(table_wise.rank_lookups())


def test_auto_with_tables_of_fewer_rows_than_ranks_still_gives_every_row_one_owner():
    tables = [("a", 3), ("b", 2), ("c", 1)]
    plan = plan_auto(tables, row_bytes_of(tables), 4, lookups_of(tables))
    assert_one_owner_per_row(plan, tables)
    assert all(s.rows for s in plan.shards)  # as plan_row_wise: no empty ranges
    assert max(plan.rank_bytes()) == 2 * 64  # 6 rows on 4 ranks: as low as whole rows allow
    assert plan_auto([], {}, 2).shards == []


def test_to_dict_is_json_and_reads_back():
    rb = row_bytes_of(KAGGLE)
    plan = plan_auto(KAGGLE, rb, 4, lookups_of(KAGGLE))
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["kind"] == "auto" and d["world_size"] == 4
    assert d["rank_bytes"] == plan.rank_bytes() and sum(d["rank_bytes"]) == sum(r * 64 for _, r in KAGGLE)
    assert d["rank_lookups"] == pytest.approx(plan.rank_lookups())
    assert sum(d["rank_lookups"]) == pytest.approx(BATCH * len(KAGGLE))
    assert d["imbalance"] == pytest.approx(max(d["rank_bytes"]) * 4 / sum(d["rank_bytes"]))
    assert d["shards"][0] == {"table": "C1", "rank": plan.shards[0].rank, "rows": [0, 1460]}
    assert len(d["shards"]) == len(plan.shards)
    back = ShardPlan.from_dict(d)
    assert back == plan and back.imbalance() == plan.imbalance()
    assert ShardPlan.from_dict(plan_table_wise(KAGGLE[:3], rb, 2).to_dict()).shards == [
        Shard(n, s.rank, 0, r) for (n, r), s in zip(KAGGLE[:3], plan_table_wise(KAGGLE[:3], rb, 2).shards)]


@pytest.mark.parametrize("kind", ["tables", "", "replicated"])
def test_plan_shards_with_a_kind_that_has_no_plan_is_a_user_error(kind):
    with pytest.raises(UserError, match=r"placement\.sharding=.*not one of"):
        plan_shards(kind, KAGGLE[:2], row_bytes_of(KAGGLE[:2]), 2)


def test_the_start_up_table_reads_at_80_columns():
    plan = plan_auto(KAGGLE, row_bytes_of(KAGGLE), 4, lookups_of(KAGGLE))
    console = Console(width=80, record=True)
    console.print(plan.table())
    for line in plan.why_lines():
        console.print(line, soft_wrap=True, highlight=False)
    text = console.export_text()
    table_lines = text.split("\n  why ")[0].splitlines()
    assert max(len(line) for line in table_lines) <= 80
    assert "sharding (auto)" in text and "lookups/step" in text
    assert "imbalance 1.017x" in " ".join(text.split())
    assert "T[lo:hi]" in text  # the caption's brackets are not taken for markup
    # every shard's label whole on one line: C3's four ranges, the small tables by name
    for s in plan.shards_of("C3"):
        assert f"C3[{s.lo}:{s.hi}]" in text
    assert all(any(line.startswith(f"  why {name}:") for line in text.splitlines()) for name in plan.reasons)
    # the shards column is never squeezed to a few characters
    header = next(line for line in table_lines if "shards" in line)
    assert len(header.split("┃")[2]) >= 24


def test_recsys_report_reads_the_entry_to_dict_writes(tmp_path):
    from recsys_cli.report.runs import Run

    plan = plan_auto(KAGGLE, row_bytes_of(KAGGLE), 4, lookups_of(KAGGLE))
    run = Run(dir=tmp_path, rel=".", summary=json.loads(json.dumps({"sharding": plan.to_dict()})))
    per_rank = run.sharding_per_rank()
    assert per_rank is not None
    assert [r["bytes"] for r in per_rank] == plan.rank_bytes()
    assert [r["lookups"] for r in per_rank] == pytest.approx(plan.rank_lookups())
    assert [r["shards"] for r in per_rank] == [len([s for s in plan.owned(r) if s.rows]) for r in range(4)]
    assert run.sharding_imbalance == pytest.approx(plan.imbalance())
