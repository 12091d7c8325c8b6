"""`trainer.resume=last` (or a path) takes the resumed run's own overrides
(issue 42 item 5): a resume no longer needs the original command line
repeated, says which overrides it took, and an override given again wins
and is named. The end-to-end test checks the resumed run ends bit for bit
where the run it continues did."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from commands import RECSYS
from recsys_cli.errors import UserError
from recsys_cli.train.resume_overrides import with_saved_overrides
from train_config import assert_states_equal


def fake_run(run: Path, saved: list[str], step: int = 10) -> Path:
    """A run directory with .hydra/overrides.yaml and a checkpoint latest.json names (its content unread here)."""
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in saved))
    checkpoints = run / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / f"step-{step:08d}.pt").write_bytes(b"")
    (checkpoints / "latest.json").write_text(json.dumps({"file": f"step-{step:08d}.pt", "step": step}))
    return checkpoints / f"step-{step:08d}.pt"


SAVED = ["dataset.synthetic.rows=4000", "placement=lookahead", "trainer.max_steps=20", "trainer.resume=last",
         "trainer.init_from=older/run"]


def test_the_runs_overrides_come_first_and_the_command_line_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "r1", SAVED)
    given = ["trainer.resume=last", "trainer.max_steps=30", "hydra.run.dir=r1", "placement=lookahead"]
    restored = with_saved_overrides(given)
    # trainer.resume and trainer.init_from are never taken; the command line's come last, so they win
    assert restored.overrides == ["dataset.synthetic.rows=4000", *given]
    assert restored.taken == ["dataset.synthetic.rows=4000"]
    assert restored.replaced == [("trainer.max_steps=20", "trainer.max_steps=30")]
    line = restored.line()
    assert f"{tmp_path / 'r1' / '.hydra' / 'overrides.yaml'}: dataset.synthetic.rows=4000;" in line
    assert "the command line's trainer.max_steps=30 (not trainer.max_steps=20) wins" in line
    assert "placement=lookahead" not in line  # given again with the same value: neither taken nor replaced


def test_a_checkpoint_path_or_the_latest_run_finds_its_run(tmp_path, monkeypatch):
    """trainer.resume=PATH into a new run directory; trainer.resume=last with
    no directory given (the newest run under outputs/, as the trainer finds it)."""
    monkeypatch.chdir(tmp_path)
    checkpoint = fake_run(tmp_path / "outputs" / "2026-01-01" / "12-00-00", SAVED)
    for given in ([f"trainer.resume={checkpoint}", "hydra.run.dir=elsewhere"], [f"trainer.resume={checkpoint.parent}"],
                  ["trainer.resume=last"], ["trainer.resume=true"]):
        restored = with_saved_overrides(given)
        assert restored.taken == SAVED[:3], given
        assert restored.overrides == [*SAVED[:3], *given]


def test_checkpoints_kept_elsewhere_are_matched_by_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "step-00000010.pt").write_bytes(b"")
    (tmp_path / "ck" / "latest.json").write_text(json.dumps({"file": "step-00000010.pt", "step": 10}))
    (tmp_path / "r1" / ".hydra").mkdir(parents=True)
    (tmp_path / "r1" / ".hydra" / "overrides.yaml").write_text("- trainer.checkpoint_dir=ck\n- precision=int8\n")
    restored = with_saved_overrides(["trainer.resume=last", "hydra.run.dir=r1"])
    assert restored.taken == ["trainer.checkpoint_dir=ck", "precision=int8"]


def test_nothing_is_taken_without_a_resume_in_a_sweep_or_without_a_saved_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "r1", SAVED)
    for given in (["hydra.run.dir=r1"], ["trainer.resume=null", "hydra.run.dir=r1"],
                  ["-m", "trainer.resume=last", "hydra.run.dir=r1"]):
        restored = with_saved_overrides(given)
        assert restored.overrides == given and not restored.taken and restored.line() == "", given
    (tmp_path / "r1" / ".hydra" / "overrides.yaml").unlink()  # a run whose overrides were not saved
    restored = with_saved_overrides(["trainer.resume=last", "hydra.run.dir=r1"])
    assert not restored.taken and restored.line() == ""


def test_a_damaged_overrides_file_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "r1", [])
    (tmp_path / "r1" / ".hydra" / "overrides.yaml").write_text("placement: lookahead\n")
    with pytest.raises(UserError, match=r"r1/.hydra/overrides.yaml is not a list of overrides"):
        with_saved_overrides(["trainer.resume=last", "hydra.run.dir=r1"])


def test_a_bad_override_in_the_saved_file_names_the_file(tmp_path, monkeypatch, capsys):
    """A misspelt key among the resumed run's overrides was 'unknown key' alone:
    nothing on the command line had it; the line names the file it came from."""
    from commands import train_in_process
    from test_bad_input import assert_user_error

    fake_run(tmp_path / "r1", ["trainer.max_stepz=30"])
    r = train_in_process(["trainer.resume=last", "hydra.run.dir=r1"], cwd=tmp_path, capsys=capsys,
                         monkeypatch=monkeypatch)
    assert_user_error(r, "unknown key 'trainer.max_stepz' (in the overrides the resume took from "
                         f"{tmp_path / 'r1' / '.hydra' / 'overrides.yaml'})")
    # The command line's own mistake stays the command line's.
    r = train_in_process(["trainer.resume=last", "hydra.run.dir=r1", "trainer.foo=1"], cwd=tmp_path, capsys=capsys,
                         monkeypatch=monkeypatch)
    assert "in the overrides the resume took" not in assert_user_error(r, "bad configuration: unknown key")


ARGS = ["dataset.synthetic.rows=4000", "dataset.synthetic.cardinality_scale=0.001", "dataset.synthetic.seed=3",
        "placement=lookahead", "precision=int8", "placement.cache_ratio=0.05", "trainer.batch_size=64",
        "trainer.max_steps=30", "trainer.checkpoint_every=10", "trainer.log_every=10", "trainer.progress=false"]


def test_resume_last_alone_continues_the_run_bit_for_bit(tmp_path):
    """Run 30 steps (checkpoints at 10, 20, 30), keep the step-30 state, take
    the step-30 checkpoint away (as a kill -9 after step 20 would), and
    resume with `trainer.resume=last` and no other override but one that
    may change: the run's own overrides are taken (the data, placement and
    precision, which the schema's defaults would contradict), the given
    trainer.log_every wins, and step 30 is the uninterrupted run's, tensor
    for tensor."""
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache")}

    def recsys(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([RECSYS, "train", *args], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return r

    recsys(*ARGS, "hydra.run.dir=run")
    checkpoints = tmp_path / "run" / "checkpoints"
    end = torch.load(checkpoints / "step-00000030.pt", weights_only=False)
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    for name in ("step-00000030.pt", "step-00000030.files.json"):
        (checkpoints / name).unlink()
    (checkpoints / "latest.json").write_text(json.dumps({"file": "step-00000020.pt", "step": 20}))

    r = recsys("trainer.resume=last", "trainer.log_every=5", "hydra.run.dir=run")
    out = "".join(r.stdout.split())  # rich may wrap, even inside a path: compared without white space
    said = lambda text: "".join(text.split()) in out  # noqa: E731
    taken = " ".join(a for a in ARGS if a != "trainer.log_every=10")
    assert said(f"resume: took the run's overrides from {tmp_path / 'run' / '.hydra' / 'overrides.yaml'}: {taken};"), \
        r.stdout[:1500]
    assert said("the command line's trainer.log_every=5 (not trainer.log_every=10) wins"), r.stdout[:1500]
    assert said(f"resumed from {checkpoints / 'step-00000020.pt'} at step 20"), r.stdout[:1500]
    again = torch.load(checkpoints / "step-00000030.pt", weights_only=False)
    assert_states_equal(end, again)
    assert again["step"] == 30 and again["config"]["trainer"]["log_every"] == 5
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final"] == final
    saved = (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()
    assert "trainer.resume=last" in saved and "placement=lookahead" in saved  # what the resumed run composed


def test_a_refused_resume_leaves_the_runs_record_and_a_plain_resume_still_works(tmp_path):
    """A resume refused for another config (optimizer=adagrad against a run
    trained with sgd) changes nothing in the run directory: .hydra/ keeps the
    overrides and config the run trained with, byte for byte, so the next
    plain `trainer.resume=true` takes them and continues."""
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache")}

    def recsys(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([RECSYS, "train", *args, "hydra.run.dir=run"], cwd=tmp_path, env=env,
                              capture_output=True, text=True)

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}

    run = tmp_path / "run"
    first = recsys("trainer.max_steps=20", "dataset.synthetic.rows=4000", "trainer.batch_size=64", "trainer.progress=false")
    assert first.returncode == 0, first.stderr[-2000:]
    before = files()

    refused = recsys("trainer.resume=true", "optimizer=adagrad")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "was trained with another config: optimizer.lr=" in refused.stderr and "Traceback" not in refused.stderr
    assert files() == before  # .hydra/overrides.yaml and config.yaml the run's, nothing else changed

    plain = recsys("trainer.resume=true", "trainer.max_steps=30")
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
    out = "".join(plain.stdout.split())  # rich may wrap, even inside a path: compared without white space
    assert "optimizer=adagrad" not in out and "".join(f"resumed from {run / 'checkpoints'}/step-00000020.pt".split()) in out
    saved = (run / ".hydra" / "overrides.yaml").read_text()  # the accepted resume's record: what it composed
    assert "trainer.max_steps=30" in saved and "dataset.synthetic.rows=4000" in saved and "adagrad" not in saved


def test_a_checkpoint_kept_elsewhere_gives_the_values_of_its_saved_config(tmp_path, monkeypatch):
    """No run directory with saved overrides (checkpoints in trainer.checkpoint_dir,
    a new hydra.run.dir): the checkpoint's saved config is the run's, and
    every value where it differs from the command line's composition is
    taken back as key=value; composing them gives the saved config again."""
    from omegaconf import OmegaConf

    from recsys_cli.config import register_configs
    from recsys_cli.train.app import check_overrides

    register_configs()
    monkeypatch.chdir(tmp_path)
    original = ["placement=lookahead", "precision=int8", "optimizer=adagrad", "trainer.max_steps=20",
                "+placement.overrides.C3=host", "model.bottom_mlp=[64,32,16]", "dataset.synthetic.rows=3000"]
    saved = OmegaConf.to_container(check_overrides(original), resolve=True)
    saved["dataset"]["path"] = "/data/it's a dir, [1]\\"  # a quote, a comma, brackets, a final backslash
    (tmp_path / "ck").mkdir()
    torch.save({"config": saved, "step": 10}, tmp_path / "ck" / "step-00000010.pt")
    (tmp_path / "ck" / "latest.json").write_text(json.dumps({"file": "step-00000010.pt", "step": 10}))
    given = ["trainer.resume=last", "trainer.checkpoint_dir=ck", "hydra.run.dir=new", "trainer.max_steps=30"]

    restored = with_saved_overrides(given, check_overrides)
    assert {"placement.kind=lookahead", "precision.kind=int8", "optimizer.name=adagrad",
            "+placement.overrides.C3=host", "model.bottom_mlp=[64,32,16]"} <= set(restored.taken), restored.taken
    assert not any(t.startswith(("trainer.max_steps", "trainer.resume", "trainer.checkpoint_dir"))
                   for t in restored.taken)
    assert restored.line().startswith("took the values of ck/step-00000010.pt's saved config that differ: ")
    again = OmegaConf.to_container(check_overrides(restored.overrides), resolve=True)
    saved["trainer"].update(max_steps=30, resume="last", checkpoint_dir="ck")
    assert again == saved


def test_relative_paths_are_taken_against_the_directory_the_run_started_in(tmp_path, monkeypatch):
    """The run started in start/ with relative paths; it resumes from
    elsewhere/: its path overrides are taken absolute against start/ (as
    Hydra recorded it), other values and absolute paths as they were; a path
    the command line gives again is its own; a run without Hydra's record
    keeps its overrides as written."""
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    elsewhere.mkdir()
    saved = ["dataset.path=data/x", "dataset.cache_dir='my cache'", "placement.disk_path=/abs/rows",
             "trainer.checkpoint_dir=ckpts", "dataset.synthetic.rows=4000", "model.interaction=cat"]
    fake_run(start / "r1", saved)
    (start / "r1" / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {start}\n")
    monkeypatch.chdir(elsewhere)
    given = ["trainer.resume=last", f"hydra.run.dir={start / 'r1'}"]
    assert with_saved_overrides(given).taken == [
        f"dataset.path={start / 'data' / 'x'}", f"dataset.cache_dir='{start / 'my cache'}'",
        "placement.disk_path=/abs/rows", f"trainer.checkpoint_dir={start / 'ckpts'}",
        "dataset.synthetic.rows=4000", "model.interaction=cat"]
    restored = with_saved_overrides([*given, "dataset.path=other"])
    assert "dataset.path=other" in restored.overrides and restored.replaced == [("dataset.path=data/x",
                                                                                 "dataset.path=other")]
    assert not any(o.startswith(f"dataset.path={start}") for o in restored.overrides)
    (start / "r1" / ".hydra" / "hydra.yaml").unlink()
    assert with_saved_overrides(given).taken == saved
