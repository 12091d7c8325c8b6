"""Logs for batch jobs: periodic lines with stdout redirected and in app.log,
config errors before torch is imported, the auto placement table at 80 columns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from commands import RECSYS

SMALL = ["dataset.synthetic.rows=20000", "dataset.synthetic.cardinality_scale=0.0005"]
STEP_LINE = re.compile(r"step (\d+)/60 \(\d+ %\) epoch 0 loss (\d+\.\d{4}) ([\d,]+) samples/s "
                       r"elapsed \d:\d\d:\d\d ETA \d:\d\d:\d\d$")


def test_redirected_run_logs_every_log_every_steps_to_stdout_and_app_log(tmp_path):
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([RECSYS, "train", *SMALL, "trainer.max_steps=60", "trainer.log_every=20",
                             "trainer.eval_every=40", "hydra.run.dir=run"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 0, result.stderr
    for text in (result.stdout, (tmp_path / "run" / "app.log").read_text()):
        lines = text.splitlines()
        steps = [m for m in map(STEP_LINE.search, lines) if m]
        assert [int(m.group(1)) for m in steps] == [20, 40, 60]
        assert all(int(m.group(3).replace(",", "")) > 0 for m in steps)
        evals = [line for line in lines if re.search(r"eval (val|test) at step \d+: AUC 0\.\d{4} log loss", line)]
        assert [re.search(r"eval (\w+) at step (\d+)", e).groups() for e in evals] == [
            ("val", "40"), ("val", "60"), ("test", "60")]
    # Off a terminal the bar is not drawn: its one final line would repeat the last step's.
    assert not any(line.startswith("train ") for line in result.stdout.splitlines())
    # The file has the lines once each (not also through Hydra's console handler).
    assert (tmp_path / "run" / "app.log").read_text().count("step 20/60") == 1
    assert result.stdout.count("step 20/60") == 1

    # evaluate and export, redirected too, say how far they are.
    evaluate = subprocess.run([RECSYS, "evaluate", "checkpoint=run", "split=val", "plots=false",
                               "batch_size=128"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert evaluate.returncode == 0, evaluate.stderr
    shares = [int(s) for s in re.findall(r"^scoring: (\d+) % of the rows, [\d,]+ rows, .* ETA", evaluate.stderr, re.M)]
    assert len(shares) >= 5 and shares == sorted(shares) and shares[-1] == 100
    export = subprocess.run([RECSYS, "export", "checkpoint=run"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert export.returncode == 0, export.stderr
    phases = [line for line in export.stderr.splitlines() if line.startswith("export: ")]
    assert [p.split()[1] for p in phases[:3]] == ["loaded", "traced", "wrote"]
    # a synthetic dataset has no raw values: its artifact takes the dataset's ids (missing -1 -> 0)
    import torch

    from recsys_cli.export import dense_log1p, load_metadata
    from recsys_cli.inference import load_model

    artifact = tmp_path / "run" / "model-fp32.pt2"
    assert load_metadata(artifact)["mapping"] == "ids"
    loaded = load_model(tmp_path / "run", device="cpu")
    gen = torch.Generator().manual_seed(0)
    dense = torch.randint(-2, 10_000, (64, 13), generator=gen)
    ids = torch.stack([torch.randint(-1, n, (64,), generator=gen) for n in loaded.features.values()], dim=1)
    expected = torch.sigmoid(loaded.logits_onehot(dense_log1p(dense), ids.clamp(min=0)))
    assert torch.equal(torch.export.load(str(artifact)).module()(dense, ids), expected)


def test_progress_false_keeps_the_log_lines_and_quiets_stdout(tmp_path, caplog):
    """In process: the lines reach the run logger (app.log under Hydra), not the console."""
    import logging

    from rich.console import Console

    from recsys_cli.train.run_log import LOGGER
    from recsys_cli.train.trainer import Trainer
    from train_config import config

    console = Console(record=True, width=200, force_terminal=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        Trainer(config(tmp_path, trainer__max_steps=20, trainer__log_every=10), console=console).fit()
    assert "step 10/20" not in console.export_text()
    assert any(r.getMessage().startswith("step 10/20 (50 %)") for r in caplog.records)


PROBE = """
import sys
from recsys_cli.cli import main
try:
    main(["train", *sys.argv[1:], "hydra.run.dir=run"])
except SystemExit as e:
    print("exit", e.code, "torch imported:", "torch" in sys.modules)
"""


def test_config_errors_are_reported_before_torch_is_imported(tmp_path):
    """A typo, a range and a combination error: each exits 2, one line,
    with torch never imported and no run directory made."""
    for override, message in (("trainer.lgo_every=5", "unknown key 'trainer.lgo_every'"),
                              ("trainer.log_every=0", "trainer.log_every must be >= 1"),
                              ("model.bottom_mlp=[64,8]", "dot interaction needs model.embedding_dim=16")):
        result = subprocess.run([sys.executable, "-c", PROBE, override], cwd=tmp_path, capture_output=True, text=True)
        assert result.stdout.strip() == "exit 2 torch imported: False", (override, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "run").exists()


def test_placement_table_fits_80_columns_and_keeps_each_reason_whole():
    from rich.console import Console

    from recsys_cli.embeddings.placement_bytes import parse_bytes
    from recsys_cli.embeddings.placement_search import place_tables
    from recsys_cli.embeddings.table_init import TableSpec

    tables = [TableSpec("a", 1000, 16), TableSpec("b", 10_000_000, 64)]
    placed = place_tables(tables, {"a": 100, "b": 120_000}, parse_bytes("64MiB"), "int4", 0, {"b": 2000})
    console = Console(record=True, width=80)
    console.print(placed.table())
    table = console.export_text()
    for line in placed.why_lines():
        console.print(line, soft_wrap=True)
    text = console.export_text()
    assert all(len(line) <= 80 for line in table.splitlines())
    assert text.splitlines() == [f"  why {placed.reasons[name]}" for name in ("a", "b")]
    assert len(placed.reasons["b"]) > 40  # long enough that a column of its own wrapped it
