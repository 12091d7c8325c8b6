"""`recsys predict` on raw Criteo TSV: rows/s end to end, and its parts.

Model: dlrm_kaggle (16-dim embeddings, bottom 13-512-256-64-16, top
512-256-1) with Kaggle's cardinalities (33.8M embedding rows at scale 1) and
a vocabulary of the same size (every id's raw value, sorted: the lookups
search 33.8M values). Weights are untrained (DLRM's init): speed does not
depend on their values. Input: synthetic raw Criteo TSV with the Kaggle
profile. The raw file, the vocabulary and the checkpoint are built once per
run, in a process of their own, in the run's work directory. Each system
runs in its own process (peak RSS is that process's), one chunk = one pass:
  predict    `recsys predict` end to end (library call): load the
             checkpoint, parse, map, score, write the CSV
  parse+map  the same parsing and vocabulary lookups without the model
  MLPs       the model's dense half alone on in-memory batches of its size
Goal on 2 cores: >= 200k rows/s end to end, parsing included. (The export
artifact sizes per precision were answered in earlier rows.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import Benchmark, Size, System, SystemRun, work_dir
from bench.record import Cell

REPO = Path(__file__).resolve().parents[2]
MLP_ROWS = 200_000  # a rate: 200k rows are enough


@dataclass(frozen=True)
class PredictSize(Size):
    rows: int = 1_000_000
    scale: float = 1.0


@dataclass(frozen=True)
class Built:
    raw: Path
    data: Path
    checkpoint: Path


def build(work: Path, rows: int, scale: float) -> None:
    """Raw TSV, a dataset directory holding only the vocabulary, and a checkpoint."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf

    from data_tools import synthetic, vocab
    from data_tools.manifest import CRITEO_SPARSE, Manifest, SparseFeature
    from recsys_cli.config import TrainConfig
    from recsys_cli.embeddings.table_init import TableSpec, init_table
    from recsys_cli.model.dlrm import mlp
    from recsys_cli.checkpoints import save_checkpoint

    cfg = synthetic.SyntheticConfig(rows=rows, cardinality_scale=scale, seed=0)
    synthetic.write_tsv(cfg, work / "raw.tsv")
    sizes = synthetic.vocab_sizes(cfg)
    values, ids = [], []
    for f, v in enumerate(sizes):
        k = np.arange(1, v, dtype=np.int64)
        sv, si = vocab.sorted_mapping(synthetic.hex_values(f, k, cfg.seed), k.astype(np.int32))
        values.append(sv)
        ids.append(si)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    entry = vocab.write_vocabulary(data, CRITEO_SPARSE, values, ids, {"mode": "vocabulary", "min_count": 1})
    Manifest(source="criteo", sparse_features=[SparseFeature(n, v) for n, v in zip(CRITEO_SPARSE, sizes)],
             splits={}, options={"vocabulary": entry, "split_by": "none"}).save(data)
    tc = OmegaConf.structured(TrainConfig)
    tc.model = OmegaConf.merge(tc.model, OmegaConf.load(REPO / "configs" / "model" / "dlrm_kaggle.yaml"))
    torch.manual_seed(0)
    model = {f"bottom.{k}": v for k, v in mlp([13, 512, 256, 64, 16], True).state_dict().items()}
    n = len(CRITEO_SPARSE) + 1
    model.update({f"top.{k}": v for k, v in mlp([16 + n * (n - 1) // 2, 512, 256, 1], False).state_dict().items()})
    tables = {name: {"precision": "fp32", "weights": init_table(TableSpec(name, v, 16), i),
                     "state": torch.zeros(v, 0)} for i, (name, v) in enumerate(zip(CRITEO_SPARSE, sizes))}
    fingerprint = json.loads((data / "manifest.json").read_text())["options"]["vocabulary"]["fingerprint"]
    state = {"step": 0, "model": model, "tables": tables, "features": dict(zip(CRITEO_SPARSE, sizes)),
             "config": OmegaConf.to_container(tc, resolve=True), "dataset_dir": str(data.absolute()),
             "vocabulary": fingerprint, "table_tiers": {name: "device" for name in CRITEO_SPARSE}}
    save_checkpoint(work / "checkpoints", 0, state)


def built(size: PredictSize) -> Built:
    """The run's inputs, built by the first system that needs them (in a
    process of its own, so no system's peak RSS holds the build's)."""
    work = work_dir() / "predict"
    done = work / "built"
    if not done.exists():
        work.mkdir(exist_ok=True)
        code = (f"import sys; from pathlib import Path; from bench.standard.predict import build; "
                f"build(Path(sys.argv[1]), {size.rows}, {size.scale})")
        subprocess.run([sys.executable, "-c", code, str(work)], cwd=REPO, check=True)
        done.touch()
    return Built(work / "raw.tsv", work / "data", work / "checkpoints")


class Predict(SystemRun):
    def __init__(self, size: PredictSize) -> None:
        self.inputs = built(size)
        self.scoring_rates: list[float] = []

    def chunk(self) -> int:
        from recsys_cli.predict import PredictConfig, predict

        out = self.inputs.raw.parent / f"predictions-{id(self)}.csv"
        r = predict(PredictConfig(checkpoint=str(self.inputs.checkpoint), input=str(self.inputs.raw), output=str(out),
                                  progress=False, id_start=60000000))
        out.unlink()
        self.scoring_rates.append(r["rows"] / r["seconds"])
        return int(r["rows"])

    def extras(self) -> Mapping[str, Cell]:
        return {"scoring alone rows/s (last chunk)": self.scoring_rates[-1]}


class ParseMap(SystemRun):
    def __init__(self, size: PredictSize) -> None:
        from data_tools.vocab import load_vocabulary

        self.inputs = built(size)
        self.vocabulary = load_vocabulary(self.inputs.data)

    def chunk(self) -> int:
        import numpy as np

        from data_tools.criteo_input import decoded_blocks, resolve_inputs

        rows = 0
        for d, _ in decoded_blocks(resolve_inputs(str(self.inputs.raw))):
            ids = np.zeros((d.rows, 26), dtype=np.int32)
            for f in range(26):
                ids[d.present[f], f] = self.vocabulary.lookup(f, d.values[f])
            rows += d.rows
        return rows


class Mlps(SystemRun):
    def __init__(self, size: PredictSize) -> None:
        import torch

        from recsys_cli.inference import load_model

        loaded = load_model(str(built(size).checkpoint), device="cpu")
        self.model: Any = loaded.model  # a DLRM: dense_forward is its own method, not a submodule
        self.batch = int(loaded.config["trainer"]["eval_batch_size"])
        gen = torch.Generator().manual_seed(0)
        self.dense = torch.rand(self.batch, 13, generator=gen)
        self.pooled = torch.randn(self.batch, 26, 16, generator=gen) * 0.01
        self.rows = min(size.rows, MLP_ROWS)

    def chunk(self) -> int:
        import torch

        done = 0
        with torch.no_grad():
            while done < self.rows:
                self.model.dense_forward(self.dense, self.pooled)
                done += self.batch
        return done


BENCHMARK = Benchmark[PredictSize](
    name="predict",
    section="Predict: recsys predict on raw Criteo TSV (dlrm_kaggle, Kaggle cardinalities, CPU)",
    note="Goal on 2 cores: >= 200k rows/s end to end for the Kaggle model on CPU, parsing included.",
    sizes={
        "smoke": PredictSize(rows=2_000, scale=0.001, rounds=2, warmup=0),
        "standard": PredictSize(rows=1_000_000, scale=1.0, rounds=2, warmup=0),
    },
    systems=[System("predict", Predict), System("parse+map", ParseMap), System("MLPs", Mlps)],
    unit="rows",
    isolated=True,
    seconds=50,
)
