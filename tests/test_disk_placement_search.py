"""placement=auto with a host budget: the largest, coldest host tables go to disk."""

import pytest
import torch
from omegaconf import OmegaConf

from recsys_cli.config import PlacementConfig, PrecisionConfig
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import build_embeddings
from recsys_cli.embeddings.placement_bytes import allocator_reserve, device_row_bytes
from recsys_cli.embeddings.placement_search import place_tables
from recsys_cli.embeddings.table_init import TableSpec
from recsys_cli.errors import UserError

NAMES, VOCAB, DIM = ["a", "b", "c", "d"], [30, 400, 5000, 12_000], 8
TABLES = [TableSpec(n, v, DIM) for n, v in zip(NAMES, VOCAB)]
HOT = {"a": 25, "b": 300, "c": 600, "d": 900}
READS = {"a": 1000, "b": 1000, "c": 5000, "d": 100}  # d: the largest and by far the coldest per byte
UNIQUE = {"a": 10, "c": 40}


def placed(host_budget, precision="fp32", state=1):
    budget = 60 * device_row_bytes(DIM, state) + allocator_reserve(state)
    return place_tables(TABLES, HOT, budget, precision, state, UNIQUE, reads=READS,
                          host_budget_bytes=host_budget, host_cache_ratio=0.05)


def test_without_pressure_nothing_goes_to_disk():
    free = placed(None)
    assert "disk" not in free.placements.values()
    assert placed(free.expected_bytes["host"]).placements == free.placements  # exactly at the budget: fits


def test_the_coldest_largest_table_goes_first_and_the_host_bytes_fit():
    free = placed(None)
    tight = placed(free.expected_bytes["host"] - 1)
    assert tight.disk_tables == ["d"]
    assert tight.expected_bytes["host"] < free.expected_bytes["host"]
    assert tight.disk_bytes == tight.table_bytes["d"]["disk"] > 0
    assert "on disk" in tight.reasons["d"] and "host budget" in tight.reasons["d"]


def test_a_host_budget_too_small_even_for_disk_is_a_clear_error():
    with pytest.raises(UserError, match=r"placement.host_memory_budget=.* is too small: with every host table on disk"):
        placed(100)


@pytest.mark.parametrize("precision, optimizer", [("fp32", "adagrad"), ("int8", "sgd")])
def test_placed_bytes_match_what_the_groups_allocate(tmp_path, precision, optimizer):
    state = 1 if optimizer == "adagrad" else 0
    free = placed(None, precision, state)
    tight = placed(free.expected_bytes["host"] - 1, precision, state)
    assert tight.disk_tables
    placement = OmegaConf.structured(PlacementConfig(kind="lookahead", disk_path=str(tmp_path), host_cache_ratio=0.05))
    embeddings = build_embeddings(
        NAMES, VOCAB, DIM, placement, OmegaConf.structured(PrecisionConfig(kind=precision)),
        RowOptimizer(optimizer), torch.device("cpu"), 0, placements=tight.placements,
        precisions={t: ("fp32" if p == "device" else precision) for t, p in tight.placements.items()},
        cache_rows={kind: tight.cache_rows_of(kind) or None for kind in ("lookahead", "disk")},
    )
    memory = embeddings.memory()
    assert {"device": memory["device"], "host": memory["host"]} == tight.expected_bytes
    assert memory["disk"] == tight.disk_bytes


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on_a_cpu_the_host_budget_bounds_the_device_tier_too(tmp_path, device):
    """On a CPU the device tier is host memory: placement=auto with only
    placement.host_memory_budget lowered kept every table whole on the
    "device" (host RAM) within the default 64MiB device budget, nothing on
    disk. There the smaller budget bounds it; on CUDA (placed here without
    one: the search allocates nothing) device_memory_budget alone, as before."""
    from datasets import write_dataset
    from recsys_cli.data.loader import ShardLoader
    from recsys_cli.embeddings.placement import measure_and_place

    data = write_dataset(tmp_path, {"train": 600}, vocab=20_000)
    loader = ShardLoader(data, "train", 100, shuffle=False)
    batches = [b.sparse for b in loader]
    vocab = [f.vocab_size for f in loader.manifest.sparse_features]
    host_budget = 2**20  # of 3 tables x 20,000 rows x (8 + 1 state) fp32 = 2.1 MiB
    placement = OmegaConf.structured(PlacementConfig(kind="auto", device_memory_budget="64MiB",
                                                     host_memory_budget=f"{host_budget}"))
    placed = measure_and_place(loader.features, vocab, DIM, placement, OmegaConf.structured(PrecisionConfig()),
                               RowOptimizer("adagrad"), batches, torch.device(device))
    if device == "cpu":
        assert placed.budget_bytes == host_budget and placed.budget_key == "placement.host_memory_budget"
        assert placed.disk_tables and placed.expected_bytes["device"] <= host_budget
        assert placed.expected_bytes["host"] <= host_budget
        assert "placement.host_memory_budget: on a CPU the device is host memory" in str(placed.table().title)
    else:
        assert set(placed.placements.values()) == {"device"} and placed.budget_bytes == 64 * 2**20
        assert placed.budget_key == "placement.device_memory_budget"
