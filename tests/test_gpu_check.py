"""The device check's own logic, on CPU: the overlap measure of a profiler
trace, its report, and a clear refusal without a CUDA device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package
from bench.gpu_check import markdown, overlap_of  # noqa: E402


def _trace(tmp_path, copies, kernels):
    events = [{"ph": "X", "cat": "kernel", "name": "k", "ts": a, "dur": b - a, "args": {"stream": s}} for s, a, b in kernels]
    events += [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": a, "dur": b - a,
                "args": {"stream": s}} for s, a, b in copies]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_overlap_counts_side_stream_copies_under_compute_kernels(tmp_path):
    kernels = [(7, 0, 100), (7, 150, 300), (9, 0, 5)]  # stream 7 computes
    copies = [(9, 50, 170), (9, 400, 440), (7, 310, 320)]  # 50 + 20 of 160 side-stream us overlap; one on compute
    got = overlap_of(_trace(tmp_path, copies, kernels))
    assert got["compute_stream"] == 7 and got["side_copy_us"] == 160 and got["compute_stream_copy_us"] == 10
    assert got["overlapped_share"] == pytest.approx(70 / 160) and got["ok"]
    serial = overlap_of(_trace(tmp_path, [(7, 100, 150)], kernels))  # copies on the compute stream: no overlap
    assert not serial["ok"] and serial["side_copy_us"] == 0


def test_report_table_lists_every_check_and_system():
    report = {"date": "d", "device": "GPU", "tests": {"files": ["t.py"], "result": "3 passed"},
              "exact": {"fp32 lookahead == device": True, "int8 lookahead run == run": False},
              "overlap": {"ok": True, "overlapped_share": 0.5, "side_copy_us": 2000.0},
              "speed": {"device": {"samples_per_second": 1000.0, "peak_device_bytes": 2**30,
                                   "pageable_host_to_device_copies": 0},
                        "host": {"samples_per_second": 250.0, "peak_device_bytes": 2**20,
                                 "pageable_host_to_device_copies": 0}}}
    table = markdown(report)
    assert "| fp32 lookahead == device | ok |" in table and "| int8 lookahead run == run | FAILED |" in table
    assert "| host | 250 | 0.25 | 1 MiB | 0 |" in table and "50% of 2.0 ms" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_clearly_without_cuda(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())
