"""MLPerf DLRM-DCNv2 at full size on one GPU: every table on the device against int4 tables on the host.

    python -m bench.gpu_full_size [--steps 300] [--batch 16384] [--deadline 420] [--out DIR]

Issue 38, item 8's last figure: the model's 26 tables at MLPerf's sizes
(204,184,588 rows x 128, about 98 GiB in fp32; `dataset=synthetic_mlperf`)
trained on generated data by `recsys train`, each system in its own process
(one GPU cannot hold both):

  device fp32            placement=device: every table in device memory
                         (an H200's 139 GiB holds it; the memory plan refuses
                         it in one line where it does not fit, and the
                         refusal is the row)
  int4 + lookahead 1 %   precision=int4 placement=lookahead cache_ratio=0.01:
                         the tables on the host at 4 bits a value, 1 % of the
                         rows in an fp32 device cache filled a window ahead

Per system: steady samples/s (recsys's own meter: warm-up steps, evaluation
and checkpoints left out), the allocator's peak device bytes, peak host RSS,
wall seconds (the table build included) and the validation AUC after the
steps. No checkpoints are written. Writes DIR/gpu_full_size.json after each
system and prints a markdown table; `--deadline S` starts no system after S
seconds. `--dry` runs the same two commands on CPU at 1/2000 of the rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = {
    "device fp32": ["placement=device", "precision=fp32"],
    "int4 + lookahead 1 %": ["precision=int4", "placement=lookahead", "placement.cache_ratio=0.01"],
}
DRY_SCALE = 0.0005


def command(args, system: str, run_dir: Path) -> list[str]:
    scale = DRY_SCALE if args.dry else 1.0
    return [sys.executable, "-m", "recsys_cli", "train", "model=dlrm_v2", "optimizer=mlperf_dcnv2",
            "dataset=synthetic_mlperf", f"dataset.synthetic.rows={args.rows}",
            f"dataset.synthetic.cardinality_scale={scale}", *SYSTEMS[system],
            f"trainer.device={'cpu' if args.dry else 'cuda'}", f"trainer.batch_size={args.batch}",
            *([f"dataset.cache_dir={args.cache_dir}"] if args.cache_dir else []),
            f"trainer.max_steps={args.steps}", "trainer.checkpoint_every=null", "trainer.eval_every=null",
            "trainer.eval_each_epoch=false", "trainer.final_checkpoint=false", "trainer.progress=false",
            f"hydra.run.dir={run_dir}"]


def run_system(args, system: str, out_dir: Path) -> dict:
    run_dir = out_dir / system.replace(" ", "_").replace("%", "pct").replace("+", "and")
    started = time.perf_counter()
    try:
        done = subprocess.run(command(args, system, run_dir), capture_output=True, text=True,
                              timeout=args.system_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {args.system_timeout} s", "seconds": time.perf_counter() - started}
    result: dict = {"exit": done.returncode, "seconds": time.perf_counter() - started}
    summary_path = run_dir / "summary.json"
    if done.returncode != 0 or not summary_path.exists():
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        result["error"] = lines[-1] if lines else f"exit {done.returncode}, no summary.json"
        return result
    summary = json.loads(summary_path.read_text())
    result.update(samples_per_second=summary.get("samples_per_second"),
                  peak_device_bytes=summary.get("peak_device_bytes"),
                  peak_host_rss_bytes=summary.get("peak_host_rss_bytes"),
                  val_auc=((summary.get("final") or {}).get("val") or {}).get("auc"),
                  hit_rate=(summary.get("cache") or {}).get("hit_rate"))
    return result


def table(out: dict) -> str:
    def num(v, spec: str, scale: float = 1.0) -> str:
        return format(v / scale, spec) if isinstance(v, (int, float)) else "-"

    lines = ["| system | samples/s | peak device GiB | peak host RSS GiB | wall s | hit rate | val AUC | error |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in out["systems"].items():
        cells = [name, num(r.get("samples_per_second"), ",.0f"), num(r.get("peak_device_bytes"), ",.1f", 2**30),
                 num(r.get("peak_host_rss_bytes"), ",.1f", 2**30), num(r.get("seconds"), ".0f"),
                 num(r.get("hit_rate"), ".3f"), num(r.get("val_auc"), ".4f"),
                 str(r.get("error", "")).replace("|", "/")[:160]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_full_size")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=400_000, help="generated rows (the splits' 0.8/0.1/0.1)")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds after which no system starts")
    parser.add_argument("--system-timeout", type=float, default=300.0)
    parser.add_argument("--out", default="outputs/gpu-full-size")
    parser.add_argument("--cache-dir", default=None, help="where the generated data goes (dataset.cache_dir)")
    parser.add_argument("--dry", action="store_true", help=f"on CPU at {DRY_SCALE} of the rows (a smoke test)")
    args = parser.parse_args(argv)
    if not args.dry:
        import torch

        if not torch.cuda.is_available():
            print("gpu_full_size needs a CUDA device (--dry runs it on CPU)", file=sys.stderr)
            return 4
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
           "command": " ".join(["python -m bench.gpu_full_size", *(argv if argv is not None else sys.argv[1:])]),
           "systems": {}}
    for system in args.systems:
        if time.perf_counter() - started > args.deadline:
            out["systems"][system] = {"error": "not started: the deadline had passed"}
            continue
        out["systems"][system] = run_system(args, system, out_dir)
        tmp = out_dir / "gpu_full_size.json.tmp"
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(out_dir / "gpu_full_size.json")
        print(table(out), flush=True)
    return 0 if all("error" not in r for r in out["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
