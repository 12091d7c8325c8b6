"""The automatic placement search: sizes, access skew, and placements that respect the budget."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from recsys_cli.config import PlacementConfig, PrecisionConfig
from recsys_cli.data.jagged import KeyedJaggedTensor
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import build_embeddings
from recsys_cli.embeddings.access_profile import measure_access, measure_skew, rows_covering
from recsys_cli.embeddings.placement_bytes import allocator_block_bytes, allocator_reserve, device_row_bytes, parse_bytes
from recsys_cli.embeddings.placement_search import TablePlacements, place_tables
from recsys_cli.embeddings.table_init import TableSpec
from recsys_cli.errors import UserError
from devices import fresh_cuda_block


# --- parse_bytes ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("64MiB", 64 * 2**20), ("2GiB", 2 * 2**30), ("500MB", 500 * 10**6), ("1048576", 1048576),
        ("1.5GB", 1_500_000_000), ("8 KiB", 8192), ("3kb", 3000), ("10B", 10), (" 1TiB ", 2**40), ("0", 0),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "64 MeB", "-5MiB", "1e9", "12 parsecs", "None", "1,000"])
def test_parse_bytes_rejects_bad_text_naming_the_key(text):
    with pytest.raises(UserError, match=r"placement\.device_memory_budget"):
        parse_bytes(text)


# --- measure_skew ---------------------------------------------------------------------------
def slow_hot_rows(ids: list[int], fraction: float) -> int:
    """Reference: sort the counts, take the hottest rows until they serve `fraction` of the reads."""
    counts = sorted(Counter(ids).values(), reverse=True)
    total = sum(counts)
    if total == 0:
        return 0
    goal = Fraction(str(fraction)) * total
    served = 0
    for k, c in enumerate(counts, start=1):
        served += c
        if served >= goal:
            return k
    raise AssertionError("unreachable")


def zipf_batches(features, vocab, num_batches=12, batch_size=64, seed=0):
    """KeyedJaggedTensors with Zipf-like ids; feature 0 one-hot, the others 0-5 ids a sample."""
    rng = np.random.default_rng(seed)
    batches, every_id = [], {f: [] for f in features}
    for _ in range(num_batches):
        per_key = {}
        for i, (f, n) in enumerate(zip(features, vocab)):
            bags = []
            for _ in range(batch_size):
                length = 1 if i == 0 else int(rng.integers(0, 6))
                ids = ((rng.zipf(1.3 + 0.2 * i, size=length) - 1) % n).tolist()
                bags.append(ids)
                every_id[f].extend(ids)
            per_key[f] = bags
        batches.append(KeyedJaggedTensor.from_lists(per_key))
    return batches, every_id


def test_rows_covering_small_example():
    counts = np.array([1, 5, 0, 3, 1])  # 10 reads: 5 + 3 = 8
    assert rows_covering(counts, 0.8) == 2
    assert rows_covering(counts, 0.81) == 3
    assert rows_covering(counts, 0.5) == 1
    assert rows_covering(counts, 1.0) == 4  # never a row nobody read
    assert rows_covering(np.zeros(4, dtype=np.int64), 0.9) == 0


@pytest.mark.parametrize("target", [0.5, 0.7, 0.9, 0.99, 1.0])
def test_measure_skew_matches_sort_based_reference(target):
    features, vocab = ["a", "b", "c"], [50, 1000, 20000]
    batches, every_id = zipf_batches(features, vocab)
    got = measure_skew(iter(batches), features, vocab, target)
    expected = {f: slow_hot_rows(every_id[f], target) for f in features}
    assert got == expected
    if target < 1:
        assert 0 < got["c"] < len(set(every_id["c"]))  # skewed: fewer rows than were read
    else:
        assert got == {f: len(set(every_id[f])) for f in features}


def test_measure_access_counts_and_batch_unique_rows():
    features, vocab = ["a", "b", "c"], [50, 1000, 20000]
    batches, every_id = zipf_batches(features, vocab, num_batches=5)
    # Keys in another order than `features`: matched by name.
    shuffled = [KeyedJaggedTensor.from_lists({k: b.to_dict()[k] for k in ["c", "a", "b"]}) for b in batches]
    profile = measure_access(shuffled, features, vocab)
    assert profile.batches == 5
    for f, n in zip(features, vocab):
        assert profile.counts[f].tolist() == np.bincount(np.array(every_id[f], dtype=np.int64), minlength=n).tolist()
        per_batch = [len({i for bag in b.to_dict()[f] for i in bag}) for b in batches]
        assert profile.batch_unique_rows[f] == max(per_batch)
    assert profile.reads == {f: len(every_id[f]) for f in features}


def test_measure_skew_rejects_ids_outside_the_table():
    kjt = KeyedJaggedTensor.from_lists({"a": [[1], [7]]})
    with pytest.raises(UserError, match="feature a has id 7 outside its table of 5 rows"):
        measure_skew([kjt], ["a"], [5])


# --- place_tables -------------------------------------------------------------------------
def min_cache_bytes(tables, unique, state):
    return sum(min(t.num_rows, max(unique.get(t.name, 0), 1)) * device_row_bytes(t.dim, state) for t in tables)


def random_case(rng):
    n = int(rng.integers(1, 9))
    tables = [TableSpec(f"t{i}", int(rng.choice([1, 3, 10, 200, 5000, 80_000, 2_000_000]) * rng.uniform(0.5, 1.5)) or 1,
                        int(rng.choice([4, 8, 16, 64]))) for i in range(n)]
    hot = {t.name: int(t.num_rows * rng.uniform(0, 1)) for t in tables if rng.random() < 0.9}
    unique = {t.name: int(rng.integers(0, 3000)) for t in tables if rng.random() < 0.7}
    state = int(rng.integers(0, 2))
    precision = str(rng.choice(["fp32", "fp16", "int8", "int4"]))
    full = sum(t.num_rows * device_row_bytes(t.dim, state) for t in tables)
    low = min_cache_bytes(tables, unique, state)
    budget = int(rng.choice([
        rng.uniform(0, 1.2) * low,  # sometimes too small
        low + rng.uniform(0, 1) * max(full - low, 0),  # in between: the interesting part
        full * rng.uniform(1, 2),  # everything fits
    ]))
    reads = {t.name: int(rng.integers(0, 10**6)) for t in tables} if rng.random() < 0.5 else None
    return tables, hot, unique, state, precision, budget, reads


def test_allocator_block_bound_covers_the_cuda_allocators_blocks():
    sizes = [1, 511, 512, 513, 48 * 1024, 2**20 - 1, 2**20, 2**20 + 1, 9 * 2**20, 11 * 2**20, 11 * 2**20 + 1,
             19 * 2**20 + 7, 2**30 + 3]
    for n in sizes:
        assert fresh_cuda_block(n) <= allocator_block_bytes(n) <= n + 512 + 2**20
    assert allocator_block_bytes(0) == 0 and allocator_block_bytes(513) == 1024
    assert fresh_cuda_block(11 * 2**20) == 12 * 2**20 <= allocator_block_bytes(11 * 2**20)  # segment kept unsplit


def test_random_placements_never_exceed_the_budget():
    rng = np.random.default_rng(1234)
    raised = placed_runs = partial = 0
    for _ in range(400):
        tables, hot, unique, state, precision, budget, reads = random_case(rng)
        low = min_cache_bytes(tables, unique, state)
        full = sum(t.num_rows * device_row_bytes(t.dim, state) for t in tables)
        # The budget holds the CUDA allocator's blocks, not the tensors' bytes.
        full_blocks = sum(allocator_block_bytes(t) for t in (sum(t.num_rows * t.dim * 4 for t in tables),
                                                             sum(t.num_rows * state * 4 for t in tables)))
        reserve = allocator_reserve(state)  # the least rounding a split placement reserves (511 B a tensor)
        if low + reserve > budget and full_blocks > budget:
            with pytest.raises(UserError, match="placement.device_memory_budget"):
                place_tables(tables, hot, budget, precision, state, unique, reads=reads)
            raised += 1
            continue
        try:
            placed = place_tables(tables, hot, budget, precision, state, unique, reads=reads)
        except UserError:  # only where a minimum cache over 1 MiB may keep 1 MiB more of its segment
            assert full_blocks > budget and low + allocator_reserve(state, large=True) > budget
            raised += 1
            continue
        placed_runs += 1
        device = 0
        for t in tables:
            placement = placed.placements[t.name]
            assert placement in ("device", "lookahead")
            if placement == "device":
                assert t.name not in placed.cache_rows
                device += t.num_rows * device_row_bytes(t.dim, state)
            else:
                rows = placed.cache_rows[t.name]
                least = min(t.num_rows, max(unique.get(t.name, 0), 1))
                assert least <= rows < t.num_rows, (t, rows)
                device += rows * device_row_bytes(t.dim, state)
            assert t.name in placed.reasons and placed.reasons[t.name].startswith(t.name + ": ")
        assert device == placed.expected_bytes["device"] <= budget
        kinds = {p: [0, 0] for p in placed.placements.values()}
        for t in tables:  # the tensors the build allocates: rows and state per placement kind
            rows = t.num_rows if placed.placements[t.name] == "device" else placed.cache_rows[t.name]
            kinds[placed.placements[t.name]][0] += rows * t.dim * 4
            kinds[placed.placements[t.name]][1] += rows * state * 4
        assert sum(allocator_block_bytes(n) for sizes in kinds.values() for n in sizes) <= budget
        assert placed.total_cache_rows == sum(placed.cache_rows.values())
        assert set(placed.cache_rows) == {n for n, p in placed.placements.items() if p == "lookahead"}
        if full_blocks <= budget:
            assert set(placed.placements.values()) == {"device"}
        else:
            partial += 1
            assert "lookahead" in placed.placements.values()
            # Greedy leaves no room a cache could still use beyond the allocator's rounding.
            spare = budget - allocator_reserve(state, large=True) - placed.expected_bytes["device"]
            for t in tables:
                if placed.placements[t.name] == "lookahead":
                    assert spare < device_row_bytes(t.dim, state) or placed.cache_rows[t.name] >= t.num_rows - 1
    assert raised > 20 and placed_runs > 200 and partial > 50  # the loop covered every regime


def test_everything_on_the_device_when_it_fits():
    tables = [TableSpec("a", 1000, 16), TableSpec("b", 50_000, 16)]
    exact = (1000 + 50_000) * 16 * 4
    blocks = allocator_block_bytes(exact)  # the fused table is one tensor; the budget holds its allocator block
    placed = place_tables(tables, {"a": 10, "b": 100}, blocks, "int8")
    assert placed.placements == {"a": "device", "b": "device"}
    assert placed.cache_rows == {} and placed.total_cache_rows == 0
    assert placed.expected_bytes == {"device": exact, "host": 0}
    one_byte_less = place_tables(tables, {"a": 10, "b": 100}, blocks - 1, "int8")
    assert one_byte_less.placements["b"] == "lookahead"


def test_raises_when_even_one_batch_per_table_does_not_fit():
    tables = [TableSpec("a", 10_000, 16), TableSpec("b", 50_000, 16)]
    need = (300 + 2000) * 16 * 4 + allocator_reserve(0)  # and the allocator's rounding of the tensors
    with pytest.raises(UserError) as e:
        place_tables(tables, {"a": 5000, "b": 20_000}, need - 1, batch_unique_rows={"a": 300, "b": 2000})
    message = str(e.value)
    assert "placement.device_memory_budget" in message and f"{need - 1:,} bytes" in message and f"{need:,} bytes" in message
    placed = place_tables(tables, {"a": 5000, "b": 20_000}, need, batch_unique_rows={"a": 300, "b": 2000})
    assert placed.cache_rows == {"a": 300, "b": 2000} and placed.expected_bytes["device"] == (300 + 2000) * 16 * 4


def test_small_hot_tables_go_whole_to_the_device_and_big_ones_get_their_hot_rows():
    tables = [TableSpec("tiny", 20, 16), TableSpec("small", 1000, 16), TableSpec("huge", 10_000_000, 16),
              TableSpec("big", 200_000, 16)]
    hot = {"tiny": 18, "small": 900, "huge": 120_000, "big": 5000}
    unique = {"tiny": 20, "small": 100, "huge": 2000, "big": 500}
    budget = parse_bytes("12MiB")
    placed = place_tables(tables, hot, budget, "int8", 1, unique)
    assert placed.placements["tiny"] == "device" and placed.placements["small"] == "device"
    assert placed.placements["huge"] == "lookahead" and placed.cache_rows["huge"] >= 120_000
    assert placed.placements["big"] == "lookahead" and placed.cache_rows["big"] >= 5000
    assert "covers" in placed.reasons["huge"] and "90 %" in placed.reasons["huge"]
    assert placed.expected_bytes["device"] <= budget
    # A tight budget: the caches shrink toward one batch's rows, hot sets first.
    tight = place_tables(tables, hot, parse_bytes("2MiB"), "int8", 1, unique)
    assert 2000 <= tight.cache_rows["huge"] < 120_000
    assert "limited by the budget" in tight.reasons["huge"]


def test_placement_table_renders():
    from rich.console import Console

    tables = [TableSpec("a", 1000, 16), TableSpec("b", 10_000_000, 64)]
    placed = place_tables(tables, {"a": 100, "b": 120_000}, parse_bytes("64MiB"), "int4", 0, {"b": 2000})
    console = Console(record=True, width=200)
    console.print(placed.table())
    text = console.export_text()
    assert "lookahead" in text and "int4" in text and f"{placed.total_cache_rows:,}" in text
    caption = " ".join(text.split())  # the caption wraps at the table's width
    assert f"1 table behind one lookahead cache of {placed.total_cache_rows:,} rows" in caption
    assert any("b: 10.0M rows" in line for line in placed.why_lines())


def test_the_placement_caption_names_no_cache_when_every_table_is_on_the_device():
    from rich.console import Console

    tables = [TableSpec("a", 1000, 16), TableSpec("b", 50_000, 16)]
    placed = place_tables(tables, {"a": 10, "b": 100}, parse_bytes("64MiB"), "int8")
    assert set(placed.placements.values()) == {"device"}
    console = Console(record=True, width=200)
    console.print(placed.table())
    caption = " ".join(console.export_text().split())
    assert "device 3.1 MiB, host 0 B" in caption and "behind" not in caption and "table(s)" not in caption


@pytest.mark.parametrize(
    "precision, optimizer, policy",
    [("fp32", "adagrad", "lru"), ("fp32", "sgd", "lfu"), ("int8", "sgd", "lru"), ("int8", "adagrad", "lfu"),
     ("int4", "adagrad", "lru"), ("fp16", "sgd", "lfu")],
)
def test_expected_bytes_match_what_the_groups_allocate(precision, optimizer, policy):
    """The placements' byte counts are what build_embeddings then allocates for it
    (one fused lookahead group of total_cache_rows slots beside the device tables)."""
    names, vocab, dim = ["a", "b", "c", "d"], [30, 400, 5000, 12_000], 8
    tables = [TableSpec(n, v, dim) for n, v in zip(names, vocab)]
    state = 1 if optimizer == "adagrad" else 0
    full = sum(v * device_row_bytes(dim, state) for v in vocab)
    hot = {"a": 25, "b": 300, "c": 600, "d": 900}
    # fp32: leave room for some tables on the device; low precision: a budget
    # where everything is behind the cache (device tables would be built in the
    # run's precision by build_embeddings, the lead's wiring builds them fp32).
    budget = (full // 3 if precision == "fp32" else 60 * device_row_bytes(dim, state)) + allocator_reserve(state)
    placed = place_tables(tables, hot, budget, precision, state, {"a": 30 if precision == "fp32" else 10, "c": 40},
                          policy=policy)
    if precision != "fp32":
        assert set(placed.placements.values()) == {"lookahead"}
    else:
        assert set(placed.placements.values()) == {"device", "lookahead"}
    placement = OmegaConf.structured(PlacementConfig(kind="lookahead", cache_rows=placed.total_cache_rows, policy=policy))
    embeddings = build_embeddings(
        names, vocab, dim, placement, OmegaConf.structured(PrecisionConfig(kind=precision)),
        RowOptimizer(optimizer), torch.device("cpu"), 0, placements=placed.placements,
    )
    memory = embeddings.memory()
    assert {"device": memory["device"], "host": memory["host"]} == placed.expected_bytes
    assert isinstance(placed, TablePlacements)
