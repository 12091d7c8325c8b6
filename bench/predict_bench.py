"""`recsys predict` rows/s on raw TSV, and `recsys export` sizes, for the Kaggle model.

    .venv/bin/python -m bench.predict_bench [--rows 1000000] [--record] [--no-export]

Model: dlrm_kaggle (16-dim embeddings, bottom 13-512-256-64-16, top
512-256-1) with Kaggle's cardinalities (33.8M embedding rows, 2.1 GB of fp32
tables) and a vocabulary of the same size (every id's raw value, sorted:
the lookups search 33.8M values). Weights are untrained (DLRM's init): speed
and sizes do not depend on their values. Input: synthetic raw Criteo TSV
with the Kaggle profile (Zipf values over the full vocabularies).

Each system runs in its own process (peak RSS is that process's):
  predict    `recsys predict` end to end: load the checkpoint, parse, map,
             score, write the CSV; rows/s over the scoring part and over the
             whole command
  parse+map  the same parsing and vocabulary lookups without the model
  MLPs       the model alone on in-memory batches of the same size
  export     `recsys export` per precision: artifact bytes, table bytes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(work: Path, rows: int) -> tuple[Path, Path, Path]:
    """Raw TSV, a dataset directory holding only the vocabulary, and a checkpoint."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf

    from data_tools import synthetic, vocab
    from data_tools.manifest import CRITEO_SPARSE, Manifest, SparseFeature
    from recsys_cli.config import TrainConfig
    from recsys_cli.embeddings.table_init import TableSpec, init_table
    from recsys_cli.model.dlrm import mlp

    cfg = synthetic.SyntheticConfig(rows=rows, cardinality_scale=1.0, seed=0)
    raw = work / "raw.tsv"
    if not raw.exists():
        synthetic.write_tsv(cfg, raw)
    sizes = synthetic.vocab_sizes(cfg)
    data = work / "data"
    if not (data / "manifest.json").exists():
        values, ids = [], []
        for f, v in enumerate(sizes):
            k = np.arange(1, v, dtype=np.int64)
            sv, si = vocab.sorted_mapping(synthetic.hex_values(f, k, cfg.seed), k.astype(np.int32))
            values.append(sv)
            ids.append(si)
        data.mkdir(parents=True, exist_ok=True)
        entry = vocab.write_vocabulary(data, CRITEO_SPARSE, values, ids, {"mode": "vocabulary", "min_count": 1})
        Manifest(source="criteo", sparse_features=[SparseFeature(n, v) for n, v in zip(CRITEO_SPARSE, sizes)],
                 splits={}, options={"vocabulary": entry, "split": "none"}).save(data)
    ckpt = work / "checkpoints"
    if not (ckpt / "latest.json").exists():
        tc = OmegaConf.structured(TrainConfig)
        tc.model = OmegaConf.merge(tc.model, OmegaConf.load(REPO / "configs" / "model" / "dlrm_kaggle.yaml"))
        torch.manual_seed(0)
        model = {f"bottom.{k}": v for k, v in mlp([13, 512, 256, 64, 16], True).state_dict().items()}
        n = len(CRITEO_SPARSE) + 1
        model.update({f"top.{k}": v for k, v in mlp([16 + n * (n - 1) // 2, 512, 256, 1], False).state_dict().items()})
        tables = {name: {"precision": "fp32", "weights": init_table(TableSpec(name, v, 16), i),
                         "state": torch.zeros(v, 0)} for i, (name, v) in enumerate(zip(CRITEO_SPARSE, sizes))}
        state = {"step": 0, "model": model, "tables": tables, "features": dict(zip(CRITEO_SPARSE, sizes)),
                 "config": OmegaConf.to_container(tc, resolve=True), "dataset_dir": str(data.absolute()),
                 "vocabulary": entry_fingerprint(data), "table_tiers": {name: "device" for name in CRITEO_SPARSE}}
        from recsys_cli.checkpoints import save_checkpoint

        save_checkpoint(ckpt, 0, state)
    return raw, data, ckpt


def entry_fingerprint(data: Path) -> str:
    return json.loads((data / "manifest.json").read_text())["options"]["vocabulary"]["fingerprint"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- children (one system each)


def child_build(work: str, rows: int) -> dict:
    raw, data, ckpt = build(Path(work), rows)
    return {"raw": str(raw), "data": str(data), "ckpt": str(ckpt)}


def child_predict(raw: str, ckpt: str, out: str) -> dict:
    from recsys_cli.predict import PredictConfig, predict

    t = time.perf_counter()
    r = predict(PredictConfig(checkpoint=ckpt, input=raw, output=out, progress=False, id_start=60000000))
    return {"scoring_seconds": r["seconds"], "command_seconds": time.perf_counter() - t, "rows": r["rows"]}


def child_parse(raw: str, ckpt: str) -> dict:
    import numpy as np

    from data_tools.criteo_input import decoded_blocks, resolve_inputs
    from data_tools.vocab import load_vocabulary

    vocabulary = load_vocabulary(Path(ckpt).parent / "data")  # build() puts the dataset beside the checkpoints
    t = time.perf_counter()
    rows = 0
    for d, _ in decoded_blocks(resolve_inputs(raw)):
        ids = np.zeros((d.rows, 26), dtype=np.int32)
        for f in range(26):
            ids[d.present[f], f] = vocabulary.lookup(f, d.values[f])
        rows += d.rows
    return {"seconds": time.perf_counter() - t, "rows": rows}


def child_mlp(ckpt: str, rows: int) -> dict:
    import torch

    from recsys_cli.inference import load_model

    loaded = load_model(ckpt, device="cpu")
    batch = int(loaded.config["trainer"]["eval_batch_size"])
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(batch, 13, generator=gen)
    pooled = torch.randn(batch, 26, 16, generator=gen) * 0.01
    with torch.no_grad():
        loaded.model.dense_forward(dense, pooled)
        t = time.perf_counter()
        done = 0
        while done < rows:
            loaded.model.dense_forward(dense, pooled)
            done += batch
    return {"seconds": time.perf_counter() - t, "rows": done}


def child_export(ckpt: str, precision: str, out: str) -> dict:
    from recsys_cli.export import ExportConfig, export

    t = time.perf_counter()
    r = export(ExportConfig(checkpoint=ckpt, precision=precision, output=out))
    Path(out).unlink()
    return {"bytes": r["bytes"], "table_bytes": r["table_bytes"], "seconds": time.perf_counter() - t}


def run_child(name: str, *args) -> dict:
    code = (f"import json, sys; from bench.predict_bench import child_{name}, peak_rss_mb; "
            f"r = child_{name}(*{list(args)!r}); r['peak_rss_mb'] = peak_rss_mb(); print('RESULT' + json.dumps(r))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{name} failed:\n{p.stderr[-3000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--work", default=None, help="keep the generated files here (default: a temporary directory)")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="predict-bench-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        # in a child: a forked process starts with its parent's peak RSS, so the parent stays small
        built = run_child("build", str(work), args.rows)
        raw, ckpt = Path(built["raw"]), Path(built["ckpt"])
        mb = raw.stat().st_size / 2**20
        pred = run_child("predict", str(raw), str(ckpt), str(work / "preds.csv"))
        parse = run_child("parse", str(raw), str(ckpt))
        mlps = run_child("mlp", str(ckpt), min(args.rows, 200_000))  # a rate: 200k rows are enough
        row = {
            "rows": pred["rows"], "input MB": mb,
            "predict rows/s (scoring)": pred["rows"] / pred["scoring_seconds"],
            "predict rows/s (whole command)": pred["rows"] / pred["command_seconds"],
            "parse+map rows/s": parse["rows"] / parse["seconds"],
            "MLPs rows/s": mlps["rows"] / mlps["seconds"],
            "predict peak RSS MB": pred["peak_rss_mb"],
        }
        print(json.dumps(row, indent=2))
        exports = []
        if not args.no_export:
            for precision in ("fp32", "fp16", "int8", "int4"):
                e = run_child("export", str(ckpt), precision, str(work / f"model-{precision}.pt2"))
                exports.append({"precision": precision, "artifact MB": e["bytes"] / 2**20,
                                "table MB": e["table_bytes"] / 2**20, "vs fp32": None, "seconds": e["seconds"],
                                "peak RSS MB": e["peak_rss_mb"]})
            for e in exports:
                e["vs fp32"] = e["artifact MB"] / exports[0]["artifact MB"]
            print(json.dumps(exports, indent=2))
    if args.record:
        from bench.record import record

        command = f"python -m bench.predict_bench --rows {args.rows}"
        note = ("Goal on 2 cores: >= 200k rows/s end to end for the Kaggle model on CPU, parsing included. "
                "dlrm_kaggle with Kaggle's cardinalities (33.8M rows) and a vocabulary of that size; "
                "batch 4096 (the run's eval_batch_size); each column in its own process. The machine is "
                "shared by four sessions working at the same time: expect noise.")
        record("Predict: recsys predict on raw Criteo TSV (dlrm_kaggle, Kaggle cardinalities, CPU)", list(row),
               [row], command, note)
        if exports:
            record("Export: recsys export artifact size per precision (dlrm_kaggle, Kaggle cardinalities)",
                   list(exports[0]), exports, command,
                   "One torch.export .pt2 file per precision (MLPs + 26 tables + program); int8/int4 rows carry "
                   "an fp16 scale and bias each.")


if __name__ == "__main__":
    main()
