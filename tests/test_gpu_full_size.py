"""bench/gpu_full_size.py (issue 38, item 8: MLPerf DLRM-DCNv2's full-size tables on one GPU)
runs its two `recsys train` commands on CPU at 1/2000 of the rows, so the script a device
session has minutes for cannot rot: a renamed key fails here, not on the lent GPU."""

from __future__ import annotations

import json

import bench.gpu_full_size as gpu_full_size


def test_the_full_size_comparison_runs_both_systems_and_reports_each(tmp_path, capsys):
    out = tmp_path / "out"
    code = gpu_full_size.main(["--dry", "--steps", "2", "--batch", "64", "--rows", "3000", "--out", str(out),
                               "--cache-dir", str(tmp_path / "data")])
    assert code == 0
    report = json.loads((out / "gpu_full_size.json").read_text())
    assert list(report["systems"]) == list(gpu_full_size.SYSTEMS)
    for name, r in report["systems"].items():
        assert r["exit"] == 0 and "error" not in r, (name, r)
        assert r["samples_per_second"] > 0 and 0 < r["val_auc"] < 1 and r["peak_host_rss_bytes"] > 0
    assert report["systems"]["int4 + lookahead 1 %"]["hit_rate"] is not None  # the cached system's own figure
    assert report["systems"]["device fp32"]["hit_rate"] is None
    printed = capsys.readouterr().out
    assert all(f"| {name} |" in printed for name in gpu_full_size.SYSTEMS)
    assert not list(out.glob("*.tmp")) and not list(out.rglob("checkpoints/*.pt"))  # no checkpoint written


def test_a_system_recsys_refuses_is_a_row_with_its_one_line_error(tmp_path, monkeypatch):
    # On a GPU too small for fp32's 98 GiB the memory plan refuses at start-up: the row says why.
    monkeypatch.setitem(gpu_full_size.SYSTEMS, "refused", ["placement=lookahead", "placement.cache_ratio=7"])
    out = tmp_path / "out"
    code = gpu_full_size.main(["--dry", "--systems", "refused", "--steps", "2", "--rows", "3000", "--out", str(out),
                               "--cache-dir", str(tmp_path / "data")])
    got = json.loads((out / "gpu_full_size.json").read_text())["systems"]["refused"]
    assert code == 1 and got["exit"] == 2 and "cache_ratio" in got["error"] and "Traceback" not in got["error"]
