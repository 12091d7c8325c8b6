"""The start-up lines that say how big each cache is and why (cache_size.py,
EmbeddingBagCollection.cache_sizes): plain words whatever the counts and the
placement (issue: "cache cache of 26 tables", "1 tables x min(...)")."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from recsys_cli.config import PlacementConfig, PrecisionConfig
from recsys_cli.embeddings.cache_size import cache_size
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import build_embeddings
from recsys_cli.units import count_of


def test_count_of_says_one_table_and_many_tables():
    assert (count_of(1, "table"), count_of(0, "table"), count_of(26, "table")) == ("1 table", "0 tables", "26 tables")
    assert count_of(1_000, "row") == "1,000 rows"


def test_a_raised_cache_of_one_table_says_one_table():
    one = cache_size([("C3", 20_263)], None, 0.05, {"C3": 256}, 4)
    assert one.slots == 1024
    assert one.why.endswith("raised to what the 4 batches of the window can need: 1 table x min(rows, 4 x 256 ids)")
    many = cache_size([("a", 20_000), ("b", 20_000)], None, 0.01, {"a": 256, "b": 256}, 1)
    assert "raised to what one batch can need: 2 tables x min(rows, 1 x 256 ids)" in many.why


def test_multi_hot_tables_left_out_are_counted_in_words():
    one = cache_size([("a", 20_000), ("h", 5000)], None, 0.5, {"a": 256, "h": None}, 4)
    assert one.why.endswith("(1 multi-hot table has no per-batch bound and is not counted)")
    two = cache_size([("a", 20_000), ("h", 5000), ("g", 5000)], None, 0.5, {"a": 256, "h": None, "g": None}, 4)
    assert two.why.endswith("(2 multi-hot tables have no per-batch bound and are not counted)")


def _cache_lines(kind: str) -> list[str]:
    placement = OmegaConf.merge(OmegaConf.structured(PlacementConfig), {"kind": kind})
    precision = OmegaConf.structured(PrecisionConfig)
    emb = build_embeddings(["a", "b"], [3000, 5000], 4, placement, precision, RowOptimizer("sgd", 0.1),
                           torch.device("cpu"), 0, batch_ids={"a": 64, "b": 64})
    return emb.cache_sizes()


def test_the_start_up_line_names_the_cache_once():
    assert [line.split(":")[0] for line in _cache_lines("cache")] == ["on-demand cache of 2 tables (a..b)"]
    assert [line.split(":")[0] for line in _cache_lines("lookahead")] == ["lookahead cache of 2 tables (a..b)"]
