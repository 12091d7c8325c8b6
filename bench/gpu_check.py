"""`make gpu-check`: the device check, on one CUDA GPU (about 8 minutes).

    .venv/bin/python -m bench.gpu_check [--out DIR] [--steps 120] [--rows 400000]
        [--cardinality-scale 1.0] [--quick]

1. tests   pytest with RECSYS_TEST_DEVICE=cuda on the files whose tests take
           the device (the CPU run stays the default everywhere else).
2. exact   on CUDA, fp32: lookahead, cache and host placements train to the
           same per-step losses and tables as device placement (torch.equal);
           int8 behind the lookahead cache: two runs are bit for bit the same.
3. speed   the Kaggle model (dlrm_kaggle, Kaggle cardinalities x
           --cardinality-scale) at batch 2048: device vs lookahead 5 % and 1 %
           vs host placement, samples/s and the phase split of each.
4. overlap torch.profiler over steps of the lookahead 5 % run: the share of
           host-to-device copy time on side streams that overlaps kernels on
           the compute stream (the prefetch copies must overlap compute).

Writes DIR/gpu_check.json and DIR/gpu_check.md (default outputs/gpu-check);
exit code 1 if a check failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.errors import UserError
from recsys_cli.train.metrics import write_json_atomic
from recsys_cli.train.trainer import Trainer

TEST_FILES = ["tests/test_segment_reduce.py", "tests/test_device_paths.py", "tests/test_train.py"]
EXACT_PLACEMENTS = {
    "device": {"placement.kind": "device"},
    "lookahead": {"placement.kind": "lookahead", "placement.cache_rows": 1500, "placement.window": 3},
    "cache": {"placement.kind": "cache", "placement.cache_rows": 1500},
    "host": {"placement.kind": "uvm"},
}
SPEED_SYSTEMS = {
    "device": {"placement.kind": "device"},
    "lookahead 5 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.05},
    "lookahead 1 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.01},
    "host": {"placement.kind": "uvm"},
}


def config(cache_dir: Path, overrides: dict, *, rows: int, scale: float, batch: int, steps: int, kaggle: bool):
    cfg = OmegaConf.structured(TrainConfig)
    if kaggle:
        OmegaConf.update(cfg, "model", OmegaConf.load("configs/model/dlrm_kaggle.yaml"), merge=True)
        cfg.model.features = None
    cfg.dataset.cache_dir = str(cache_dir)
    cfg.dataset.synthetic.rows = rows
    cfg.dataset.synthetic.cardinality_scale = scale
    cfg.dataset.synthetic.split_ratios = [0.98, 0.01, 0.01]
    cfg.trainer.device = "cuda"
    cfg.trainer.batch_size = batch
    cfg.trainer.max_steps = steps
    cfg.trainer.progress = False
    cfg.trainer.log_every = max(1, steps // 4)
    cfg.trainer.checkpoint_every = None
    cfg.optimizer.name = "adagrad"
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def run_tests(timeout_s: int) -> dict:
    env = dict(os.environ, RECSYS_TEST_DEVICE="cuda")
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_FILES],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        tail, ok = done.stdout.strip().splitlines()[-1:] or [""], done.returncode == 0
    except subprocess.TimeoutExpired:
        tail, ok = [f"timed out after {timeout_s} s"], False
    return {"ok": ok, "files": TEST_FILES, "result": tail[0], "seconds": time.perf_counter() - start}


def train(cfg, record_losses: bool = False) -> tuple[Trainer, dict]:
    trainer = Trainer(cfg)
    trainer.record_losses = record_losses
    return trainer, trainer.fit()


def exactness(cache_dir: Path, steps: int) -> dict:
    small = dict(rows=20000, scale=0.0005, batch=128, steps=steps, kaggle=False)
    ref, _ = train(config(cache_dir, EXACT_PLACEMENTS["device"], **small), record_losses=True)
    ref_tables = ref.embeddings.table_state()
    out = {}
    for name, overrides in EXACT_PLACEMENTS.items():
        if name == "device":
            continue
        got, _ = train(config(cache_dir, overrides, **small), record_losses=True)
        tables = got.embeddings.table_state()
        out[f"fp32 {name} == device"] = (got.step_losses == ref.step_losses and all(
            torch.equal(tables[t]["weights"], ref_tables[t]["weights"]) for t in ref_tables))
    runs = []
    for _ in range(2):
        got, _ = train(config(cache_dir, {**EXACT_PLACEMENTS["lookahead"], "precision.kind": "int8"}, **small),
                       record_losses=True)
        runs.append((got.step_losses, got.embeddings.table_state()))
    (l1, t1), (l2, t2) = runs
    out["int8 lookahead run == run"] = l1 == l2 and all(
        torch.equal(t1[t][k], t2[t][k]) for t in t1 for k in t1[t] if isinstance(t1[t][k], torch.Tensor))
    return out


def overlap_of(trace_path: Path) -> dict:
    """From a chrome trace: host-to-device copy time on streams other than the
    compute stream (the one with the most kernel time), and the share of it
    that kernels on the compute stream overlap."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels, copies = {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        stream = (e.get("args") or {}).get("stream")
        if e.get("cat") == "kernel":
            kernels.setdefault(stream, []).append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            copies.append((stream, e["ts"], e["ts"] + e["dur"]))
    if not kernels:
        return {"ok": False, "reason": "no kernels in the trace"}
    compute = max(kernels, key=lambda s: sum(b - a for a, b in kernels[s]))
    busy = sorted(kernels[compute])
    side = [(a, b) for s, a, b in copies if s != compute]
    total = sum(b - a for a, b in side)
    covered = 0.0
    for a, b in side:
        for ka, kb in busy:
            if kb <= a:
                continue
            if ka >= b:
                break
            covered += min(b, kb) - max(a, ka)
    share = covered / total if total else 0.0
    return {"ok": share > 0.0, "compute_stream": compute, "side_copy_us": total,
            "compute_stream_copy_us": sum(b - a for s, a, b in copies if s == compute),
            "overlapped_share": share}


def profiled(trainer: Trainer, trace: Path) -> tuple[dict, dict]:
    """trainer.fit() with steps 20..27 traced by torch.profiler; (summary, overlap_of the trace)."""
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=20, warmup=2, active=8, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    )
    step = trainer.train_step

    def traced(batch):
        loss = step(batch)
        prof.step()
        return loss

    trainer.train_step = traced
    with prof:
        summary = trainer.fit()
    return summary, overlap_of(trace) if trace.exists() else {"ok": False, "reason": "no trace written"}


def speed(cache_dir: Path, out_dir: Path, steps: int, rows: int, scale: float) -> tuple[dict, dict]:
    big = dict(rows=rows, scale=scale, batch=2048, steps=steps, kaggle=True)
    results, overlap = {}, {}
    for name, overrides in SPEED_SYSTEMS.items():
        try:
            trainer = Trainer(config(cache_dir, overrides, **big))
        except UserError as e:  # e.g. a 1 % cache smaller than one batch at a small --cardinality-scale
            results[name] = {"error": str(e)}
            continue
        try:
            if name == "lookahead 5 %":  # steps 20..27 of this run, traced
                summary, overlap = profiled(trainer, out_dir / "lookahead_trace.json")
            else:
                summary = trainer.fit()
        except UserError as e:
            results[name] = {"error": str(e)}
            continue
        results[name] = {
            "samples_per_second": summary["samples_per_second"],
            "phase_seconds": summary["phase_seconds"],
            "peak_device_bytes": summary["peak_device_bytes"],
            "embedding_bytes_allocated": summary["embedding_bytes_allocated"],
            "pageable_host_to_device_copies": summary["pageable_host_to_device_copies"],
            "cache_hit_rate": (summary.get("cache") or {}).get("hit_rate"),
        }
        del trainer
        torch.cuda.empty_cache()
    return results, overlap


def markdown(report: dict) -> str:
    lines = [f"# gpu-check {report['date']} on {report['device']}", "",
             f"tests ({' '.join(report['tests']['files'])}): {report['tests']['result']}", "",
             "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'ok' if v else 'FAILED'} |" for k, v in report["exact"].items()]
    ov = report["overlap"]
    lines += [f"| prefetch copies overlap compute | {'ok' if ov.get('ok') else 'FAILED'} "
              f"({ov.get('overlapped_share', 0):.0%} of {ov.get('side_copy_us', 0) / 1e3:.1f} ms) |", "",
              "| placement (dlrm_kaggle, batch 2048) | samples/s | vs device | peak device | pageable copies |",
              "|---|---|---|---|---|"]
    base = report["speed"].get("device", {}).get("samples_per_second") or 0
    for name, r in report["speed"].items():
        if "error" in r:
            lines.append(f"| {name} | - | - | - | {r['error']} |")
            continue
        rate = r["samples_per_second"] or 0
        lines.append(f"| {name} | {rate:,.0f} | {rate / base if base else 0:.2f} | "
                     f"{(r['peak_device_bytes'] or 0) / 2**20:,.0f} MiB | {r['pageable_host_to_device_copies']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="outputs/gpu-check")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--cardinality-scale", type=float, default=1.0)
    parser.add_argument("--test-timeout", type=int, default=240)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not for the record")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check needs a CUDA device; none is available (it has not run)", file=sys.stderr)
        sys.exit(2)
    if args.quick:
        args.steps, args.rows, args.cardinality_scale = 40, 100_000, 0.1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(os.environ.get("RECSYS_CACHE") or tempfile.mkdtemp(prefix="recsys-gpu-check-"))
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "args": vars(args)}
    start = time.perf_counter()
    report["tests"] = run_tests(args.test_timeout)
    report["exact"] = exactness(cache_dir, steps=40)
    report["speed"], report["overlap"] = speed(cache_dir, out_dir, args.steps, args.rows, args.cardinality_scale)
    report["seconds"] = time.perf_counter() - start
    report["ok"] = report["tests"]["ok"] and all(report["exact"].values()) and bool(report["overlap"].get("ok"))
    write_json_atomic(out_dir / "gpu_check.json", report)
    table = out_dir / "gpu_check.md.tmp"
    table.write_text(markdown(report))
    table.replace(out_dir / "gpu_check.md")
    print(markdown(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
