"""`recsys report DIR`: tables, report.csv and plots of a run or a sweep."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from recsys_cli.errors import UserError
from recsys_cli.report import PLOT_NAMES, build_report, run_labels, run_report
from commands import RECSYS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PHASES = ("data_wait", "embedding_forward", "mlp_forward", "backward", "sparse_update", "dense_update", "eval")


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- a sweep run by the real trainer ------------------------------------------------------------
@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory):
    """`recsys train -m +placement=device,lookahead ...` as a user would run it."""
    tmp = tmp_path_factory.mktemp("sweep")
    sweep = tmp / "multirun"
    env = {**os.environ, "RECSYS_CACHE": str(tmp / "cache")}
    result = subprocess.run(
        [RECSYS, "train", "-m", "+placement=device,lookahead", "trainer.max_steps=30", "dataset.synthetic.rows=5000",
         "trainer.checkpoint_every=null", f"hydra.sweep.dir={sweep}"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return sweep


def test_report_of_a_real_sweep(real_sweep, tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([RECSYS, "report", str(real_sweep), "--out", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "placement=device" in result.stdout and "placement=lookahead" in result.stdout
    rows = read_csv(out / "report.csv")
    assert [r["run"] for r in rows] == ["placement=device", "placement=lookahead"]
    assert [r["dir"] for r in rows] == ["0", "1"]
    device, lookahead = rows
    # The documented `+placement=` spelling is recorded as the defaults-list override Hydra applied.
    assert lookahead["overrides"].split() == ["placement=lookahead", "trainer.max_steps=30",
                                              "dataset.synthetic.rows=5000", "trainer.checkpoint_every=null"]
    assert (device["placement"], lookahead["placement"]) == ("device", "lookahead")
    for r in rows:
        assert 0 <= float(r["val_auc"]) <= 1 and float(r["val_logloss"]) > 0 and float(r["samples_per_second"]) > 0
        assert sum(float(r[f"seconds_{p}"]) for p in PHASES) > 0
        assert 0 <= float(r["dedup_ratio"]) <= 1
    # Exact caching: the lookahead run learns exactly what the device run learns.
    assert device["val_auc"] == lookahead["val_auc"]
    assert device["cache_hit_rate"] == "" and 0 < float(lookahead["cache_hit_rate"]) <= 1
    assert int(device["host_bytes"]) == 0 < int(lookahead["host_bytes"])
    assert int(lookahead["device_bytes"]) < int(device["device_bytes"])
    for name in PLOT_NAMES.values():
        assert_png(out / name)
    assert not (real_sweep / "report.csv").exists()  # --out: nothing written into DIR
    summary = json.loads((real_sweep / "1" / "summary.json").read_text())
    assert float(lookahead["samples_per_second"]) == pytest.approx(summary["samples_per_second"])


# --- sweeps written by hand: every shape the report must handle -----------------------------------
def write_run(run_dir: Path, overrides: list[str], placement="device", precision="fp32", window=4, cache_rows=None,
              sps=20_000.0, auc=0.74, steps=100, cache_slots=None, hit_rate=None, phase_scale=1.0,
              steady=True, disk: dict | None = None) -> None:
    """A run directory as the trainer leaves it: summary.json, metrics.jsonl, .hydra/overrides.yaml;
    disk: the disk tier's cache statistics (+placement=disk), with "disk_bytes" on disk."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    cache = {}
    if cache_slots is not None:
        hits = int(hit_rate * 10_000)
        cache = {"hits": hits, "misses": 10_000 - hits, "rows_loaded": 10_000 - hits, "rows_evicted": 5000,
                 "rows_written_back": 5000, "bytes_to_device": 1 << 20, "bytes_to_host": 1 << 20, "not_admitted": 0,
                 "prepare_seconds": 0.4 * phase_scale, "cache_slots": cache_slots, "hit_rate": hit_rate}
        if placement == "lookahead":
            cache.update(window_used_min=1, window_used_mean=window - 0.5)
    phases = dict(zip(PHASES, [0.2, 0.5, 1.0, 2.0, 0.3, 0.2, 0.4]))
    summary = {
        "steps": steps, "samples": steps * 128, "samples_per_second": sps, "train_seconds": steps * 128 / sps,
        "final": {"val": {"auc": auc, "logloss": 0.47, "accuracy": 0.78, "samples": 5000},
                  "test": {"auc": auc - 0.01, "logloss": 0.48, "accuracy": 0.77, "samples": 5000}},
        "phase_seconds": {k: v * phase_scale for k, v in phases.items()},
        "embedding_bytes": {"device": 4_000_000 if cache_slots is None else cache_slots * 64,
                            "host": 0 if cache_slots is None else 4_500_000, "table": 4_000_000,
                            "cache": (cache_slots or 0) * 64, "index": 0},
        "peak_host_rss_bytes": 400 << 20, "peak_device_bytes": None, "device": "cpu",
        "placement": placement, "precision": precision, "dedup": False, "cache": cache,
        "duplication": {"duplicated_ids": 0.83, "duplicated_ids_per_feature": {"C1": 0.9}, "lookups_saved_by_dedup": 0.0},
        "config": {"placement": {"kind": placement, "cache_rows": cache_rows, "cache_ratio": 0.05, "window": window,
                                 "policy": "lru", "overrides": {}, "device_max_rows": None, "device_memory_budget": None},
                   "precision": {"kind": precision}},
    }
    if disk is not None:
        disk = dict(disk)
        summary["embedding_bytes"]["disk"] = disk.pop("disk_bytes")
        summary["cache"].update(disk)
    if steady:  # a summary with the steady-state figure (train/throughput.py); older ones have none
        wall = steps * 128 / sps + 3.0
        summary["throughput"] = {"steady_samples_per_second": sps, "wall_seconds": wall, "eval_seconds": 2.0,
                                 "checkpoint_seconds": 1.0, "wall_samples_per_second": steps * 128 / wall,
                                 "warmup_steps": 10, "steps": steps}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    lines = [{"step": s, "epoch": 0, "loss": 0.5 - s / 1000, "samples_per_second": sps} for s in (50, 100)]
    lines.append({"step": steps, "split": "val", **summary["final"]["val"]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture
def cache_sweep(tmp_path) -> Path:
    """A lookahead sweep over window x cache_rows, a device baseline, a nested
    run and a run whose summary.json is corrupt."""
    root = tmp_path / "multirun"
    common = ["trainer.max_steps=100"]
    write_run(root / "0", ["+placement=device", *common], sps=30_000, auc=0.7412)
    i = 1
    for window in (1, 4):
        for rows in (1000, 10_000):
            write_run(root / str(i if i < 4 else 10), ["+placement=lookahead", f"placement.window={window}",
                                                      f"placement.cache_rows={rows}", *common],
                      placement="lookahead", window=window, cache_rows=rows, cache_slots=rows,
                      hit_rate=0.5 + 0.1 * (rows == 10_000) + 0.05 * window, sps=10_000 + 1000 * window,
                      auc=0.7412, phase_scale=1 + 1 / window)
            i += 1
    write_run(root / "nested" / "0", ["+placement=lookahead", "+precision=int8", "placement.window=4",
                                      "placement.cache_rows=1000", *common],
              placement="lookahead", precision="int8", window=4, cache_rows=1000, cache_slots=1000, hit_rate=0.7,
              auc=0.7405)
    (root / "5" / ".hydra").mkdir(parents=True)
    (root / "5" / "summary.json").write_text('{"steps": 10, "samples_per')  # killed mid-write (no rename)
    return root


def test_report_of_a_cache_sweep(cache_sweep):
    console = Console(record=True, width=220)
    report = build_report(cache_sweep, console=console)
    text = console.export_text()
    # Natural order (10 after 3), the nested run found, the corrupt run skipped by name.
    assert [r.rel for r in report.runs] == ["0", "1", "2", "3", "10", "nested/0"]
    assert [p for p, _ in report.skipped] == [cache_sweep / "5" / "summary.json"]
    assert f"skipped {cache_sweep / '5' / 'summary.json'}" in text.replace("\n", "")
    labels = [r["run"] for r in report.rows]
    assert labels == [
        "placement=device",
        "placement=lookahead window=1 cache_rows=1000",
        "placement=lookahead window=1 cache_rows=10000",
        "placement=lookahead window=4 cache_rows=1000",
        "placement=lookahead window=4 cache_rows=10000",
        "placement=lookahead window=4 cache_rows=1000 precision=int8",
    ]
    for label in labels:
        assert label in text
    rows = read_csv(cache_sweep / "report.csv")
    assert [r["run"] for r in rows] == labels
    assert rows[0]["cache_hit_rate"] == "" and float(rows[1]["cache_hit_rate"]) == pytest.approx(0.55)
    assert rows[5]["precision"] == "int8" and float(rows[5]["val_auc"]) == pytest.approx(0.7405)
    assert float(rows[2]["samples_per_second"]) == 11_000 and int(rows[0]["device_bytes"]) == 4_000_000
    assert float(rows[1]["seconds_backward"]) == pytest.approx(4.0) and float(rows[1]["dedup_ratio"]) == 0.83
    assert float(rows[1]["train_loss"]) == pytest.approx(0.4)  # the last logged training loss
    assert rows[0]["overrides"] == "+placement=device trainer.max_steps=100"
    assert sorted(p.name for p in report.plots) == sorted(PLOT_NAMES.values())
    for path in report.plots:
        assert_png(path)
    assert not [p for p in cache_sweep.iterdir() if p.name.endswith(".tmp")]  # renamed, nothing left behind


def test_report_without_a_cache_skips_the_cache_plot_and_says_so(tmp_path):
    root = tmp_path / "sweep"
    write_run(root / "0", ["+placement=device", "optimizer.lr=0.05"], auc=0.73)
    write_run(root / "1", ["+placement=device", "optimizer.lr=0.1"], auc=0.74)
    (root / PLOT_NAMES["cache"]).write_bytes(b"stale")  # from an earlier report of other runs
    console = Console(record=True, width=200)
    report = build_report(root, console=console)
    assert [r["run"] for r in report.rows] == ["lr=0.05", "lr=0.1"]
    assert not (root / PLOT_NAMES["cache"]).exists()
    assert any("no run uses a cache" in n for n in report.notes)
    assert "no run uses a cache" in console.export_text()
    for name in ("throughput", "auc", "phases"):
        assert_png(root / PLOT_NAMES[name])


def test_report_of_a_single_run_directory(tmp_path, capsys):
    run = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    write_run(run, [], placement="lookahead", cache_slots=500, hit_rate=0.9, cache_rows=500)
    run_report([str(run)])
    out = capsys.readouterr().out
    assert "12-00-00" in out and "lookahead/fp32" in out and "0.900" in out
    rows = read_csv(run / "report.csv")
    assert len(rows) == 1 and rows[0]["dir"] == "." and rows[0]["run"] == "12-00-00"
    for name in PLOT_NAMES.values():
        assert_png(run / name)


def test_falls_back_to_metrics_jsonl_for_a_run_without_final_metrics(tmp_path):
    write_run(tmp_path / "r", ["+placement=device"], auc=0.7123)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    del summary["final"]
    (tmp_path / "r" / "summary.json").write_text(json.dumps(summary))
    report = build_report(tmp_path, plots=False)
    assert report.rows[0]["val_auc"] == pytest.approx(0.7123) and report.plots == []


@pytest.mark.parametrize("make", ["missing", "empty", "only_corrupt", "file"])
def test_errors_name_the_directory(tmp_path, make):
    target = tmp_path / "runs"
    if make == "empty":
        (target / "0" / ".hydra").mkdir(parents=True)
    elif make == "only_corrupt":
        (target / "0").mkdir(parents=True)
        (target / "0" / "summary.json").write_text("[1, 2")
    elif make == "file":
        target.write_text("not a directory")
    with pytest.raises(UserError) as e:
        run_report([str(target)])
    assert str(target) in str(e.value)


def test_cli_prints_the_error_without_a_traceback(tmp_path, capsys):
    from recsys_cli.cli import main

    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path / "nowhere")])
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "error:" in err and "nowhere" in err and "does not exist" in err and "Traceback" not in err


def test_run_labels_keep_only_what_differs_and_stay_unique():
    labels = run_labels(
        [["+placement=lookahead", "placement.cache_ratio=0.1", "precision.cache_ratio=0.01", "optimizer.lr=0.1"],
         ["+placement=lookahead", "placement.cache_ratio=0.2", "precision.cache_ratio=0.02", "optimizer.lr=0.1"],
         ["+placement=lookahead", "placement.cache_ratio=0.2", "precision.cache_ratio=0.02", "optimizer.lr=0.1"]],
        ["0", "1", "2"],
    )
    # Same last part in two keys: the full keys stay; a repeated label gets its directory.
    assert labels == [
        "placement.cache_ratio=0.1 precision.cache_ratio=0.01",
        "placement.cache_ratio=0.2 precision.cache_ratio=0.02 [1]",
        "placement.cache_ratio=0.2 precision.cache_ratio=0.02 [2]",
    ]
    assert run_labels([["a.b=1"], ["a.b=1"]], ["x", "y"]) == ["x", "y"]
    assert run_labels([["+dedup=on", "trainer.seed=3"]], ["r"]) == ["dedup=on seed=3"]


def test_report_module_imports_neither_matplotlib_nor_torch_until_needed():
    code = "import sys, recsys_cli.cli, recsys_cli.report; sys.exit('matplotlib' in sys.modules or 'torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_steady_state_throughput_is_shown_as_such_and_older_summaries_are_not_passed_off_as_it(tmp_path):
    root = tmp_path / "multirun"
    write_run(root / "0", ["optimizer.lr=0.1"], sps=20_000.0)
    write_run(root / "1", ["optimizer.lr=0.2"], sps=15_000.0, steady=False)  # before the meter: fit-loop samples/s
    console = Console(width=300, record=True)
    build_report(root, console=console, plots=False)
    text = " ".join(console.export_text().split())  # the caption wraps
    assert "steady samples/s" in text and "evaluation and checkpoints left out" in text
    new, old = read_csv(root / "report.csv")
    assert float(new["samples_per_second"]) == 20_000 and float(new["eval_seconds"]) == 2.0
    assert float(new["wall_samples_per_second"]) == pytest.approx(100 * 128 / (100 * 128 / 20_000 + 3.0))
    assert old["samples_per_second"] == "" and float(old["wall_samples_per_second"]) == 15_000


def test_the_console_shows_the_disk_tier_when_a_run_has_one(tmp_path):
    root = tmp_path / "multirun"
    write_run(root / "0", ["+placement=lookahead"], placement="lookahead", cache_slots=500, hit_rate=0.9)
    console = Console(width=300, record=True)
    build_report(root, console=console, plots=False)
    assert "disk tier" not in console.export_text()  # no run has one
    write_run(root / "1", ["+placement=disk"], placement="disk", cache_slots=500, hit_rate=0.9,
              disk={"disk_bytes": 3 << 30, "disk_bytes_read_per_step": 540_000, "disk_bytes_written_per_step": 2048,
                    "disk_read_amplification": 4.3, "host_cache_hit_rate": 0.125, "disk_wait_seconds_per_step": 0.0021})
    console = Console(width=300, record=True)
    build_report(root, console=console, plots=False)
    text = console.export_text()
    disk_table = text[text.index("disk tier"):]
    (line,) = [ln for ln in disk_table.splitlines() if "placement=disk" in ln]
    for cell in ("3.0 GiB", "527 KiB", "2.0 KiB", "4.30", "0.125", "2.1"):
        assert cell in line, (cell, line)
    assert "placement=lookahead" not in disk_table  # only runs with a disk tier
    assert "read amp" in disk_table and "wait ms/step" in disk_table


# A sharded run's "sharding" entry as the trainer writes it (ShardPlan.to_dict), by hand: 2 ranks,
# C1 whole on rank 1, C2 split row-wise, C3 whole on rank 0 (64-byte rows).
SHARDING = {
    "kind": "auto", "world_size": 2,
    "shards": [{"table": "C1", "rank": 1, "rows": [0, 1000]}, {"table": "C2", "rank": 0, "rows": [0, 5000]},
               {"table": "C2", "rank": 1, "rows": [5000, 10000]}, {"table": "C3", "rank": 0, "rows": [0, 10]}],
    "rank_bytes": [5010 * 64, 6000 * 64], "rank_lookups": [2048.0, 3072.0], "imbalance": 6000 / 5505,
    "table_rows": {"C1": 1000, "C2": 10000, "C3": 10}, "row_bytes": {"C1": 64, "C2": 64, "C3": 64},
    "lookups": {"C1": 1024.0, "C2": 2048.0, "C3": 1024.0}, "reasons": {"C2": "C2: row-wise, ..."},
}


def test_the_console_shows_a_sharded_runs_ranks(tmp_path):
    root = tmp_path / "multirun"
    write_run(root / "0", ["trainer.nproc=2"])
    console = Console(width=300, record=True)
    build_report(root, console=console, plots=False)
    assert "sharded tables" not in console.export_text()  # replicated: no sharding entry
    write_run(root / "1", ["trainer.nproc=2", "placement.sharding=auto"])
    summary = json.loads((root / "1" / "summary.json").read_text())
    (root / "1" / "summary.json").write_text(json.dumps({**summary, "sharding": SHARDING}))
    console = Console(width=80, record=True, force_terminal=True)  # an 80-column terminal (off one, lines are not wrapped)
    build_report(root, console=console, plots=False)
    text = console.export_text()
    part = text[text.index("sharded tables, per rank"):]
    lines = part.splitlines()
    (first,) = [ln for ln in lines if "sharding=auto" in ln]
    second = lines[lines.index(first) + 1]
    for cell in ("auto", "313 KiB", "2,048", "1.090x"):  # rank 0: C2's first half and C3
        assert cell in first, (cell, first)
    for cell in ("375 KiB", "3,072"):  # rank 1: C1 and C2's second half
        assert cell in second, (cell, second)
    assert [ln.split("│")[2:4] for ln in (first, second)] == [[" auto ", "    0 "], ["      ", "    1 "]]
    assert "(1/2)" not in part  # one table at 80 columns
    assert "nproc=2 " not in part.replace("sharding=auto", "")  # only the sharded run
    assert max(len(ln) for ln in text.splitlines()) <= 80
    replicated, sharded = read_csv(root / "report.csv")
    assert replicated["sharding"] == "" and replicated["sharding_rank_bytes"] == ""
    assert sharded["sharding"] == "auto" and sharded["sharding_ranks"] == "2"
    assert float(sharded["sharding_imbalance"]) == pytest.approx(6000 / 5505)
    assert sharded["sharding_rank_bytes"] == "320640 384000" and sharded["sharding_rank_lookups"] == "2048.0 3072.0"
    assert sharded["sharding_rank_shards"] == "2 2"


def test_a_sharding_entry_without_rank_bytes_is_left_out_not_fatal(tmp_path):
    write_run(tmp_path / "run", [])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (tmp_path / "run" / "summary.json").write_text(json.dumps({**summary, "sharding": {"kind": "row"}}))
    console = Console(width=120, record=True)
    report = build_report(tmp_path / "run", console=console, plots=False)
    assert "sharded tables" not in console.export_text() and report.rows[0]["sharding"] is None
    # the plan under "distributed" (beside the strategy's own figures) is read too
    distributed = {"mode": "sharded", "world_size": 2, "sharding": SHARDING}
    (tmp_path / "run" / "summary.json").write_text(json.dumps({**summary, "distributed": distributed}))
    report = build_report(tmp_path / "run", plots=False)
    assert report.rows[0]["sharding"] == "auto" and report.rows[0]["sharding_rank_shards"] == [2, 2]


# --- plots: labels that do not collide, totals inside the frame, one AUC axis per dataset (issue 28) ---------------
def mixed_sweep(tmp_path: Path) -> Path:
    """Four runs differing in several keys (long stacked labels), two on the
    synthetic data and two on a Criteo dataset, the tallest phase bar last."""
    root = tmp_path / "mixed"
    specs = [("synthetic", None, "device", "fp32", 0.76), ("synthetic", None, "lookahead", "int8", 0.75),
             ("criteo_kaggle", "data/kaggle", "device", "fp32", 0.79), ("criteo_kaggle", "data/kaggle", "lookahead", "int8", 0.80)]
    for i, (name, path, placement, precision, auc) in enumerate(specs):
        run = root / str(i)
        write_run(run, [f"dataset={name}", f"placement={placement}", f"precision={precision}",
                        f"placement.cache_ratio=0.0{i + 1}", f"optimizer.lr=0.0{i + 5}"],
                  placement=placement, precision=precision, auc=auc, phase_scale=1.0 + i)
        summary = json.loads((run / "summary.json").read_text())
        summary["config"]["dataset"] = {"name": name, "path": path}
        (run / "summary.json").write_text(json.dumps(summary))
    return root


def drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()


def assert_labels_apart(ax, renderer) -> None:
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert len(boxes) >= 2
    for left, right in zip(boxes, boxes[1:]):
        assert left.x1 < right.x0, (left, right)  # "placement=lookaheadplacement=lookahead" before


def test_plot_labels_do_not_collide_and_totals_stay_inside_the_frame(tmp_path):
    from recsys_cli.report.plots import _bar_by_run, _phase_figure

    report = build_report(mixed_sweep(tmp_path), plots=False)
    runs = report.runs
    assert all(len(r.label.split()) >= 4 for r in runs)  # several keys differ
    for fig in (_phase_figure(runs), _bar_by_run(runs, [r.steady_samples_per_second for r in runs], "t", "y", ",.0f",
                                                  zoom=False)):
        renderer = drawn(fig)
        ax = fig.axes[0]
        assert_labels_apart(ax, renderer)
        frame = ax.get_window_extent(renderer)
        values = [t for t in ax.texts if t.get_text()]
        assert values and all(frame.y0 <= t.get_window_extent(renderer).y1 <= frame.y1 for t in values), \
            "a bar's value label is clipped at the top of the plot"


def test_auc_plot_has_one_axis_per_dataset(tmp_path):
    from recsys_cli.report.plots import _auc_figure, by_dataset

    report = build_report(mixed_sweep(tmp_path), plots=True)
    assert_png(report.out / PLOT_NAMES["auc"])
    groups = by_dataset(report.runs)
    assert list(groups) == ["synthetic", "criteo_kaggle (data/kaggle)"]
    fig = _auc_figure(report.runs)
    renderer = drawn(fig)
    assert len(fig.axes) == 2
    for ax, (dataset, members) in zip(fig.axes, groups.items()):
        assert dataset in ax.get_title()
        assert [t.get_text() for t in ax.texts] == [f"{r.final('val', 'auc'):.4f}" for r in members]
        lo, hi = ax.get_ylim()
        aucs = [r.final("val", "auc") for r in members]
        assert lo < min(aucs) and max(aucs) < hi and hi - lo < 0.05  # each zoomed to its own data
        assert_labels_apart(ax, renderer)
