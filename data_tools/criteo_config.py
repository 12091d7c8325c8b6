"""`recsys preprocess criteo`'s options (CriteoConfig) and their checks; see data_tools/criteo.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from data_tools import shards as sh
from data_tools.errors import UserError

ALL_SPLIT = "all"  # the one split of split_by=none
MIN_MEMORY_BUDGET = 64 << 20


@dataclass
class CriteoConfig:
    # The raw Criteo TSV to read (Kaggle train.txt, Terabyte day_*; plain or
    # .gz): a file, a glob ('day_*.gz', natural order) or a list: input=[day_0.gz,day_1.gz].
    input: Any = None
    # The dataset directory to write (built under <output>.tmp-<pid>, renamed at the end).
    output: Optional[str] = None
    # Vocabulary mode: values seen at least min_count times get ids 1..V-1 by
    # descending frequency (ties by value); rarer and missing values share id 0.
    min_count: int = 1
    # Hashing mode instead (one pass): id = 1 + value % (hash_buckets - 1), missing -> 0.
    hash_buckets: Optional[int] = None
    # Vocabulary mode: at most this many ids a feature (MLPerf's 40000000):
    # ids >= max_vocab fold onto 1 + (id - 1) % (max_vocab - 1), as the MLPerf
    # DLRM-DCNv2 reference takes its contiguous ids modulo 40M.
    max_vocab: Optional[int] = None
    # Vocabulary mode: count values in at most about this many bytes (bytes,
    # or 4GiB, 500MB): values go by hash to partition files that are counted
    # one at a time. None: count every value in memory at once.
    memory_budget: Any = None
    # Processes that parse and encode blocks of text (0: one per core, one for
    # an input under 64 MiB). The output is byte-identical for every number.
    workers: int = 0
    label_dtype: str = "float32"  # the label column's type: float32 | int8
    # How rows are cut into splits: kaggle (DLRM: 7 days, the last day halved
    # into test and val) | terabyte (Criteo 1TB: each input file is a day,
    # day_0 .. day_23; train = days 0-22, day 23 halved into test then val;
    # 2-23 days are a sample, the last one halved) | ratios (see split_ratios)
    # | none (one split, "all", of every row). Once `split=`: in predict and
    # evaluate split= names one split.
    split_by: str = "kaggle"
    # train, val, test for split_by=ratios (the synthetic data's word); once `ratios=`.
    split_ratios: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])
    on_error: str = "raise"  # a malformed line: raise (stop naming file, line, column) | skip (drop and count)
    row_group_rows: int = sh.DEFAULT_ROW_GROUP_ROWS  # rows per parquet row group
    shard_rows: int = sh.DEFAULT_SHARD_ROWS  # rows per shard file
    compression: str = "snappy"  # parquet compression of the shards
    block_size: int = 8 << 20  # bytes of text parsed at a time
    # Vocabulary mode: keep pass 1's parsed rows in a temporary Arrow file in
    # the output's temporary directory (about 160 bytes a row, removed at the
    # end) so that pass 2 does not parse the text again; false: pass 2 re-reads the input.
    spill: bool = True
    # Map values with this dataset's saved vocabulary (a `recsys preprocess`
    # output) in one pass instead of building one; values it has no id for ->
    # 0, counted per feature in manifest.options.unknown_values.
    vocab: Optional[str] = None
    # false: 39-column input without the label column (Criteo's test.txt); the shards get no label column.
    labels: bool = True
    progress: bool = True  # a progress bar on a terminal


def output_dir(cfg: CriteoConfig) -> Path:
    """The dataset directory output= names; a UserError when it is not given."""
    if cfg.output is None or cfg.output == "":
        raise UserError("output=DIR is required")
    return Path(cfg.output).expanduser()


def validate(cfg: CriteoConfig) -> None:
    output_dir(cfg)
    if cfg.label_dtype not in ("float32", "int8"):
        raise UserError(f"label_dtype must be float32 or int8, got {cfg.label_dtype!r}")
    if cfg.split_by not in ("kaggle", "terabyte", "ratios", "none"):
        raise UserError(f"split_by must be kaggle, terabyte, ratios or none, got {cfg.split_by!r}")
    if cfg.workers < 0:
        raise UserError(f"workers must be >= 0 (0: one per core), got {cfg.workers}")
    if cfg.max_vocab is not None:
        if cfg.max_vocab < 2:
            raise UserError(f"max_vocab must be >= 2 (id 0 is for missing and rare values), got {cfg.max_vocab}")
        if cfg.hash_buckets is not None or cfg.vocab is not None:
            raise UserError("max_vocab caps a vocabulary this run builds: it does not apply with hash_buckets or vocab")
    if cfg.memory_budget is not None:
        if isinstance(cfg.memory_budget, bool) or not isinstance(cfg.memory_budget, int):
            raise UserError(f"memory_budget must be a byte count, got {cfg.memory_budget!r}")
        if cfg.memory_budget < MIN_MEMORY_BUDGET:
            raise UserError(f"memory_budget must be at least {MIN_MEMORY_BUDGET >> 20} MiB, got {cfg.memory_budget}")
        if cfg.hash_buckets is not None or cfg.vocab is not None:
            raise UserError("memory_budget bounds the counting of a vocabulary this run builds: it does not apply "
                            "with hash_buckets or vocab")
    if cfg.split_by == "ratios":
        sh.ratio_ranges(1, cfg.split_ratios)
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
    check_compression(cfg.compression)


def check_compression(compression: object) -> None:
    """A parquet codec this pyarrow writes, tried on a one-row table (a name
    it does not know was an ArrowException's traceback after pass 1)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pq.write_table(pa.table({"x": [0]}), io.BytesIO(), compression=compression)
    except (pa.ArrowException, OSError, ValueError, TypeError):
        raise UserError(f"compression must be a parquet codec this pyarrow writes (none, snappy, gzip, brotli, lz4, "
                        f"zstd), got {compression!r}") from None
