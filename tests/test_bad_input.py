"""Bad input and damaged runs, as a hostile new user meets them.

Every case asserts what the user sees (exit code 2, one `error:` line naming
the file, line, feature or key, no traceback) and what is left on disk (the
user's files untouched, nothing half-written that looks valid, the last good
checkpoint kept).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_tools.manifest import MANIFEST_NAME
from datasets import write_dataset
from train_config import config

RECSYS = str(Path(sys.executable).with_name("recsys"))
SMALL = ["dataset.synthetic.rows=20000", "dataset.synthetic.cardinality_scale=0.0005", "trainer.progress=false"]


def recsys(*args, cwd, **kw):
    env = {**os.environ, "RECSYS_CACHE": str(Path(cwd) / "cache"), "COLUMNS": "200"}
    return subprocess.run([RECSYS, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, **kw)


def assert_user_error(result, *needles: str) -> str:
    """Exit 2, one `error:` line holding every needle, no traceback; returns the line."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def set_vocab(dataset: Path, feature: str, vocab: int) -> None:
    path = dataset / MANIFEST_NAME
    m = json.loads(path.read_text())
    for f in m["sparse_features"]:
        if f["name"] == feature:
            f["vocab_size"] = vocab
    path.write_text(json.dumps(m))


def tiny_dataset(tmp_path, name="data", **kw) -> Path:
    return write_dataset(tmp_path, {"train": 600, "val": 200, "test": 200}, name=name, **kw)


TINY_TRAIN = ["trainer.batch_size=50", "trainer.max_steps=6", "trainer.progress=false", "trainer.log_every=2"]


# --- 1. ids outside a table ------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["device", "lookahead"])
@pytest.mark.parametrize("feature", ["C2", "C3"])  # a middle table (would read its neighbour's rows), the last one
def test_ids_outside_a_table_name_shard_row_group_feature_id(tmp_path, placement, feature):
    data = tiny_dataset(tmp_path)
    set_vocab(data, feature, 100)
    r = recsys("train", f"dataset.path={data}", *TINY_TRAIN, f"+placement={placement}", "placement.cache_rows=500",
               "hydra.run.dir=run", cwd=tmp_path)
    line = assert_user_error(r, "train-0000", "row group", f"feature {feature}", "vocab_size 100")
    assert "is outside [0, 100)" in line
    assert not (tmp_path / "run" / "summary.json").exists()


def test_negative_ids_are_outside_the_table(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_tools.manifest import sha256_file
    from recsys_cli.data.loader import ShardLoader
    from recsys_cli.errors import UserError

    data = tiny_dataset(tmp_path)
    shard = data / "val-00000.parquet"
    table = pq.read_table(shard)
    table = table.set_column(table.schema.get_field_index("C1"), "C1", pa.array([-3] * table.num_rows, pa.int32()))
    pq.write_table(table, shard, row_group_size=100)
    m = json.loads((data / MANIFEST_NAME).read_text())
    m["splits"]["val"]["shards"][0].update(sha256=sha256_file(shard), bytes=shard.stat().st_size)
    (data / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(UserError, match=r"val-00000.parquet: row group 0, feature C1: id -3 is outside \[0, 1000\)"):
        list(ShardLoader(data, "val", 50, shuffle=False))
