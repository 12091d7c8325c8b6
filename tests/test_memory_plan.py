"""Memory refused up front (issue 40 item 4, recsys_cli/train/memory_plan.py).

The plan is checked three ways: part for part against what the built groups
allocate (exact, in-process), against the peak resident memory (VmHWM) of a
fresh process that trains (within 15 %), and a run that cannot fit is
refused in one line, before any table is built or any data generated, with
the numbers and the cheapest setting that fits; the device's free memory
(CUDA) is checked the same way, through its CPU twin here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import build_embeddings
from recsys_cli.errors import UserError
from recsys_cli.train import memory_plan
from recsys_cli.train.memory_plan import Room, Table

FEATURES, VOCAB = ["C1", "C2", "C3", "C4"], [9_000, 300, 2_000, 7]


def train_config(**overrides):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.trainer.batch_size = 128  # the schema's default when these tests were written (now 256)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, merge=True)
    return cfg


@pytest.mark.parametrize("placement, precision, optimizer, extra", [
    ("device", "fp32", "sgd", {}), ("device", "fp32", "adagrad", {}), ("uvm", "fp32", "sgd", {}),
    ("lookahead", "fp32", "sgd", {}), ("lookahead", "int8", "adagrad", {}), ("device", "int4", "sgd", {}),
    ("host", "int8", "sgd", {"precision__policy": "lfu"}), ("cache", "fp16", "sgd", {"placement__window": 2}),
    ("disk", "int8", "adagrad", {}), ("lookahead", "int4", "sgd", {"placement__overrides": {"C2": "device"}}),
])
def test_the_plan_is_what_the_groups_allocate(tmp_path, placement, precision, optimizer, extra):
    cfg = train_config(placement__kind=placement, precision__kind=precision, optimizer__name=optimizer,
                       placement__disk_path=str(tmp_path), **extra)
    built = build_embeddings(FEATURES, VOCAB, 16, cfg.placement, cfg.precision, RowOptimizer(optimizer, 0.1),
                             torch.device("cpu"), 0, batch_ids=dict.fromkeys(FEATURES, cfg.trainer.batch_size))
    held = built.memory()
    plan = memory_plan.plan(cfg, [Table(f, n) for f, n in zip(FEATURES, VOCAB)], on_device=False)
    h = plan.host
    disk = held["disk"]  # a disk table's rows are in its file, not in memory
    assert h["tables"] + h["optimizer state"] == held["table"] - disk
    assert h["caches"] == held["cache"] and h["cache indexes"] == held["index"]
    assert plan.host_bytes - h["model"] - h["loader buffers"] - h["build scratch"] - h["checkpoint peak"] == \
        held["host"] + held["device"]


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """`recsys train model=dlrm_v2 dataset.synthetic.cardinality_scale=4.0` asked for 69 GB after 13 s
    and died in a 40-line allocator traceback."""
    from commands import train_in_process

    monkeypatch.setenv("RECSYS_MEMORY_LIMIT", "16GiB")
    start = time.perf_counter()
    # in this process, Hydra's app state and logging put back afterwards (its
    # app.log handler would otherwise outlive the removed run directory)
    done = train_in_process(["model=dlrm_v2", "dataset.synthetic.cardinality_scale=4.0", "hydra.run.dir=run"],
                            cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    seconds = time.perf_counter() - start
    err = done.stderr
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("error: not enough memory: the run needs about 64.7 GiB of host memory (tables 64.4 GiB, "
                           "model "), line
    assert "this process may use " in line and "Nothing was built" in line
    if "RECSYS_MEMORY_LIMIT=16GiB" in line:  # the machine itself has more room than that
        assert "; placement=lookahead precision=int4 would fit (" in line, line
    assert seconds < 30  # refused at start-up: not the minutes of generating the data and building 69 GB
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # no data generated
    assert not (tmp_path / "run").exists()  # the failed start removed its run directory


def test_the_device_twin_refuses_what_the_device_cannot_hold():
    """On CUDA the device's free memory is the limit of device tables and caches
    (memory_plan.available reads torch.cuda.mem_get_info); the same check on
    made-up numbers: tables that fit the host, not the device."""
    cfg = train_config(model__embedding_dim=64, model__bottom_mlp=[64])
    tables = [Table(f"C{i}", 1_000_000) for i in range(1, 5)]  # 977 MiB of fp32 rows
    room = Room(host=64 << 30, host_why="MemAvailable", device=512 << 20, device_why="free on cuda:0")
    with pytest.raises(UserError) as e:
        memory_plan.check(cfg, tables, room, on_device=True)
    message = str(e.value)
    assert message.startswith("not enough memory: the run needs about 977 MiB of device memory (tables 977 MiB, "), message
    assert "this process may use 512 MiB (free on cuda:0); placement=lookahead would fit (" in message, message
    plan = memory_plan.check(train_config(model__embedding_dim=64, model__bottom_mlp=[64], placement__kind="lookahead"),
                             tables, room, on_device=True)
    assert plan.host["tables"] == 4_000_000 * 64 * 4 and plan.device["tables"] == 0
    assert 0 < plan.device["caches"] < 512 << 20
    # No setting fits: sharding over machines is what is left, with how many.
    with pytest.raises(UserError, match=r"no setting fits one process here: shard the tables over \d+ or more processes"):
        memory_plan.check(cfg, [Table(f"C{i}", 400_000_000) for i in range(1, 5)], Room(1 << 30, "MemAvailable"),
                          on_device=False)


def test_available_memory_is_the_smallest_of_what_limits_the_process(monkeypatch):
    # MemAvailable moves while other processes run (the suite's other
    # worker): the rule is checked on fixed readings, the real one only
    # against the machine's total.
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    real = memory_plan.available()
    assert real.host is not None and 0 < real.host <= total
    monkeypatch.setattr(memory_plan, "mem_available", lambda: 8 << 30)
    monkeypatch.setattr(memory_plan, "cgroup_room", lambda: None)
    assert memory_plan.available() == Room(8 << 30, "MemAvailable")
    monkeypatch.setattr(memory_plan, "cgroup_room", lambda: (2 << 30, "the cgroup's limit"))
    assert memory_plan.available() == Room(2 << 30, "the cgroup's limit")
    monkeypatch.setenv("RECSYS_MEMORY_LIMIT", "100MiB")
    assert memory_plan.available() == Room(100 << 20, "RECSYS_MEMORY_LIMIT=100MiB")
    monkeypatch.setenv("RECSYS_MEMORY_LIMIT", "64GiB")
    assert memory_plan.available().host == 2 << 30


# --- the plan against the peak a training process reaches ----------------------------------------------------------

PEAK_SCRIPT = """
import json, sys
from omegaconf import OmegaConf
from recsys_cli.config import TrainConfig
from recsys_cli.train.memory import peak_rss_bytes
from recsys_cli.train.trainer import Trainer
cfg = OmegaConf.structured(TrainConfig)
for key, value in json.loads(sys.argv[1]).items():
    OmegaConf.update(cfg, key, value, merge=True)
trainer = Trainer(cfg)
trainer.fit()
print(json.dumps({"plan": trainer.memory_plan, "peak": peak_rss_bytes()}))
"""

PLACEMENTS = {
    "device": {},
    "lookahead": {"placement.kind": "lookahead", "placement.cache_ratio": 0.01},
    "int8": {"placement.kind": "lookahead", "placement.cache_ratio": 0.01, "precision.kind": "int8"},
    "int4": {"precision.kind": "int4"},
    "disk": {"placement.kind": "disk", "placement.cache_ratio": 0.01, "placement.host_cache_ratio": 0.5},
}


@pytest.fixture(scope="module")
def wide_tables(tmp_path_factory):
    """Few rows, wide vocabularies: tables of about 128 MB in fp32, a quarter of the process's peak."""
    from datasets import write_dataset

    return write_dataset(tmp_path_factory.mktemp("wide"), {"train": 1000, "val": 200, "test": 0}, onehot=4,
                         vocab=500_000, row_group_size=500, shard_rows=1000)


@pytest.mark.parametrize("name", [
    "device", pytest.param("lookahead", marks=pytest.mark.verify), pytest.param("int8", marks=pytest.mark.verify),
    pytest.param("int4", marks=pytest.mark.verify), pytest.param("disk", marks=pytest.mark.verify),
])
def test_the_plan_is_within_15_percent_of_the_peak(wide_tables, tmp_path, name):
    overrides = {"dataset.path": str(wide_tables), "dataset.name": "criteo_kaggle", "trainer.progress": False,
                 "trainer.batch_size": 100, "trainer.max_steps": 6, "trainer.eval_every": None,
                 "trainer.eval_each_epoch": False, "optimizer.lr": 0.01, "placement.disk_path": str(tmp_path),
                 **PLACEMENTS[name]}
    r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, json.dumps(overrides)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    plan, peak = out["plan"], out["peak"]
    expected = plan["rss_before_bytes"] + plan["host_bytes"]
    assert plan["host_bytes"] > 0.2 * peak  # what the plan itemises is a part of the peak a miss would show
    print(f"{name}: planned {expected / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB ({expected / peak:.3f})")
    assert abs(expected - peak) <= 0.15 * peak, (name, expected, peak, plan["host"])


def test_the_cgroup_limit_is_read_for_v2_and_v1(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text("1073741824\n")
    (tmp_path / "job" / "memory.current").write_text("268435456\n")
    assert memory_plan.cgroup_room(tmp_path, proc)[0] == 768 << 20
    (tmp_path / "job" / "memory.max").write_text("max\n")  # no limit
    assert memory_plan.cgroup_room(tmp_path, proc) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    proc.write_text("4:memory:/job\n0::/\n")
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory" / "job" / "memory.usage_in_bytes").write_text(str(1 << 30))
    room, why = memory_plan.cgroup_room(v1, proc)
    assert room == 1 << 30 and why == "the cgroup's limit 2.0 GiB, 1.0 GiB in use"
