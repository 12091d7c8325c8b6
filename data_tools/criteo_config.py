"""`recsys preprocess criteo`'s options (CriteoConfig) and their checks; see data_tools/criteo.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from data_tools import shards as sh
from data_tools.errors import UserError

ALL_SPLIT = "all"  # the one split of split=none


@dataclass
class CriteoConfig:
    # A path, a glob ("day_*.gz") or a list of paths/globs.
    input: Any = None
    output: Optional[str] = None
    min_count: int = 1
    hash_buckets: Optional[int] = None
    label_dtype: str = "float32"  # float32 | int8
    split: str = "kaggle"  # kaggle | ratios | none (one split, "all", of every row)
    ratios: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])
    on_error: str = "raise"  # raise | skip
    row_group_rows: int = sh.DEFAULT_ROW_GROUP_ROWS
    shard_rows: int = sh.DEFAULT_SHARD_ROWS
    compression: str = "snappy"
    block_size: int = 8 << 20  # bytes of text parsed at a time
    # Vocabulary mode: keep pass 1's parsed rows in a temporary Arrow file in
    # the output's temporary directory (about 160 bytes a row) so that pass 2
    # does not parse the text again; false: pass 2 re-reads the input.
    spill: bool = True
    # Map values with this dataset's saved vocabulary (a `recsys preprocess`
    # output) in one pass instead of building one; unseen values -> id 0.
    vocab: Optional[str] = None
    # false: 39-column input without the label column (Criteo's test.txt).
    labels: bool = True
    progress: bool = True


def validate(cfg: CriteoConfig) -> None:
    if cfg.output in (None, ""):
        raise UserError("output=DIR is required")
    if cfg.label_dtype not in ("float32", "int8"):
        raise UserError(f"label_dtype must be float32 or int8, got {cfg.label_dtype!r}")
    if cfg.split not in ("kaggle", "ratios", "none"):
        raise UserError(f"split must be kaggle, ratios or none, got {cfg.split!r}")
    if cfg.split == "ratios":
        sh.ratio_ranges(1, cfg.ratios)
    if cfg.on_error not in ("raise", "skip"):
        raise UserError(f"on_error must be raise or skip, got {cfg.on_error!r}")
    if cfg.min_count < 1:
        raise UserError(f"min_count must be >= 1, got {cfg.min_count}")
    if cfg.hash_buckets is not None:
        if cfg.hash_buckets < 2:
            raise UserError(f"hash_buckets must be >= 2 (id 0 is for missing values), got {cfg.hash_buckets}")
        if cfg.hash_buckets > 2**31:
            raise UserError(f"hash_buckets must be <= 2**31 (ids are int32), got {cfg.hash_buckets}")
        if cfg.min_count != 1:
            raise UserError("min_count and hash_buckets exclude each other: hashing keeps every value")
    if cfg.vocab is not None and (cfg.hash_buckets is not None or cfg.min_count != 1):
        raise UserError("vocab=DIR maps values with DIR's vocabulary: min_count and hash_buckets do not apply")
    if not cfg.labels and cfg.vocab is None and cfg.hash_buckets is None:
        raise UserError("labels=false needs vocab=DIR (the training data's vocabulary) or hash_buckets=N")
    if cfg.row_group_rows < 1 or cfg.shard_rows < 1:
        raise UserError("row_group_rows and shard_rows must be >= 1")
    if cfg.block_size < 1024:
        raise UserError(f"block_size must be >= 1024 bytes, got {cfg.block_size}")
