"""Bad input and damaged runs, as a hostile new user meets them.

Every case asserts what the user sees (exit code 2, one `error:` line naming
the file, line, feature or key, no traceback) and what is left on disk (the
user's files untouched, nothing half-written that looks valid, the last good
checkpoint kept).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_tools.manifest import MANIFEST_NAME
from datasets import write_dataset
from train_config import config
from commands import RECSYS, completed_in_process, in_process, train_in_process


def recsys(*args, cwd, **kw):
    env = {**os.environ, "RECSYS_CACHE": str(Path(cwd) / "cache"), "COLUMNS": "200"}
    return subprocess.run([RECSYS, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, **kw)


@pytest.fixture
def train(tmp_path, capsys, monkeypatch):
    """`recsys train ARGS` in tmp_path, as recsys() runs it but by main() in this
    process (commands.train_in_process): these tests are about the line a run
    prints, its exit status and the files it leaves, not the process. The
    real-process cases: test_a_truncated_shard_fails_at_start (a UserError
    from the trainer under Hydra's app), test_hydras_own_keys_exit_2 (Hydra's
    own exit), test_a_failed_checkpoint_write_is_one_line_exit_2_and_leaves_no_tmp."""
    def run(*args):
        return train_in_process(list(args), cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    return run


def assert_user_error(result, *needles: str) -> str:
    """Exit 2, one `error:` line holding every needle, no traceback; returns the line."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def set_vocab(dataset: Path, feature: str, vocab: int) -> None:
    path = dataset / MANIFEST_NAME
    m = json.loads(path.read_text())
    for f in m["sparse_features"]:
        if f["name"] == feature:
            f["vocab_size"] = vocab
    path.write_text(json.dumps(m))


def tiny_dataset(tmp_path, name="data", **kw) -> Path:
    return write_dataset(tmp_path, {"train": 600, "val": 200, "test": 200}, name=name, **kw)


# The test datasets' first dense feature is the row index (up to 600): a smaller step than the default
# keeps the loss finite with the DLRM initialisation.
LR = 0.01
TINY_TRAIN = ["trainer.batch_size=50", "trainer.max_steps=6", "trainer.progress=false", "trainer.log_every=2",
              f"optimizer.lr={LR}"]


# --- 1. ids outside a table ------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["device", "lookahead"])
@pytest.mark.parametrize("feature", ["C2", "C3"])  # a middle table (would read its neighbour's rows), the last one
def test_ids_outside_a_table_name_shard_row_group_feature_id(tmp_path, placement, feature, train):
    data = tiny_dataset(tmp_path)
    set_vocab(data, feature, 100)
    r = train(f"dataset.path={data}", *TINY_TRAIN, f"+placement={placement}", "placement.cache_rows=500",
              "hydra.run.dir=run")
    line = assert_user_error(r, "train-0000", "row group", f"feature {feature}", "vocab_size 100")
    assert "is outside [0, 100)" in line
    assert not (tmp_path / "run" / "summary.json").exists()


def test_negative_ids_are_outside_the_table(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_tools.manifest import sha256_file
    from recsys_cli.data.loader import ShardLoader
    from recsys_cli.errors import UserError

    data = tiny_dataset(tmp_path)
    shard = data / "val-00000.parquet"
    table = pq.read_table(shard)
    table = table.set_column(table.schema.get_field_index("C1"), "C1", pa.array([-3] * table.num_rows, pa.int32()))
    pq.write_table(table, shard, row_group_size=100)
    m = json.loads((data / MANIFEST_NAME).read_text())
    m["splits"]["val"]["shards"][0].update(sha256=sha256_file(shard), bytes=shard.stat().st_size)
    (data / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(UserError, match=r"val-00000.parquet: row group 0, feature C1: id -3 is outside \[0, 1000\)"):
        list(ShardLoader(data, "val", 50, shuffle=False))


# --- 3. preprocess replaces only what it wrote -------------------------------------------------------------------


def criteo_lines(n: int, seed: int = 0, columns: int = 40) -> str:
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        fields = [str(rng.randint(0, 1))] + [str(rng.randint(0, 50)) for _ in range(13)]
        fields += [f"{rng.randint(0, 40):08x}" for _ in range(26)]
        lines.append("\t".join(fields[40 - columns:]))
    return "\n".join(lines) + "\n"


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_preprocess_replaces_only_its_own_files(tmp_path):
    from data_tools.criteo import CriteoConfig, preprocess

    raw = tmp_path / "raw.tsv"
    raw.write_text(criteo_lines(700))
    out = tmp_path / "ds"
    cfg = CriteoConfig(input=str(raw), output=str(out), progress=False, row_group_rows=50, shard_rows=100)
    preprocess(cfg)
    first = set(files_of(out))
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "keep.parquet").write_text("also mine")
    raw.write_text(criteo_lines(300, seed=1))  # fewer rows: fewer shards than before
    m = preprocess(CriteoConfig(input=str(raw), output=str(out), progress=False, row_group_rows=50, shard_rows=100))
    after = files_of(out)
    assert after["notes.txt"] == b"mine" and after["mine/keep.parquet"] == b"also mine"
    shards = {s.file for split in m.splits.values() for s in split.shards}
    vocab = {e[k]["file"] for e in m.options["vocabulary"]["files"].values() for k in ("values", "ids")}
    assert set(after) == shards | vocab | {"manifest.json", ".recsys-files.json", "notes.txt", "mine/keep.parquet"}
    assert len(first - set(after)) > 0  # the old dataset's surplus shards are gone
    assert not list(tmp_path.glob("ds.*"))  # no temporary or old directory left


def test_preprocess_refuses_to_overwrite_a_file_it_did_not_write(tmp_path):
    from data_tools.criteo import CriteoConfig, preprocess
    from recsys_cli.errors import UserError

    raw = tmp_path / "raw.tsv"
    raw.write_text(criteo_lines(300))
    out = tmp_path / "ds"
    preprocess(CriteoConfig(input=str(raw), output=str(out), progress=False))
    listed = json.loads((out / ".recsys-files.json").read_text())
    (out / ".recsys-files.json").write_text(json.dumps([f for f in listed if f != "train/part-00000.parquet"]))
    before = files_of(out)
    with pytest.raises(UserError, match=r"holds train/part-00000.parquet, which recsys did not write"):
        preprocess(CriteoConfig(input=str(raw), output=str(out), progress=False))
    assert files_of(out) == before


def test_a_users_file_where_a_split_folder_goes_is_refused_and_changes_nothing(tmp_path):
    """A user's file `train` in a split_by=none dataset, then a run that writes
    train/: refused up front naming it (the commit moved the old dataset aside,
    failed on the folder, said the output was as it was and left it without a
    manifest, the old dataset in ds.old-PID for the next run to delete)."""
    from data_tools.criteo import CriteoConfig, preprocess
    from recsys_cli.errors import UserError

    raw = tmp_path / "raw.tsv"
    raw.write_text(criteo_lines(300))
    out = tmp_path / "ds"
    preprocess(CriteoConfig(input=str(raw), output=str(out), progress=False, split_by="none"))
    (out / "train").write_text("mine")
    before = files_of(out)
    with pytest.raises(UserError, match=r"holds train, which recsys did not write"):
        preprocess(CriteoConfig(input=str(raw), output=str(out), progress=False))
    assert files_of(out) == before
    assert not list(tmp_path.glob("ds.*"))


def test_a_failed_commit_puts_the_previous_dataset_back(tmp_path, monkeypatch):
    """A move that fails half way through replacing a dataset (here the third
    new file) leaves the previous dataset at the output, whole, as the error
    line says, and nothing beside it."""
    from data_tools import dataset_dir
    from data_tools.criteo import CriteoConfig, preprocess
    from recsys_cli.errors import UserError

    raw = tmp_path / "raw.tsv"
    raw.write_text(criteo_lines(300))
    out = tmp_path / "ds"
    preprocess(CriteoConfig(input=str(raw), output=str(out), progress=False, split_by="none"))
    (out / "notes.txt").write_text("mine")
    before = files_of(out)
    move, calls = dataset_dir._move, []

    def failing_move(src, dst):
        if ".tmp-" in src.parent.as_posix() or ".tmp-" in src.parent.parent.as_posix():
            calls.append(src)
            if len(calls) == 3:
                raise OSError(errno.EIO, "Input/output error")
        move(src, dst)

    monkeypatch.setattr(dataset_dir, "_move", failing_move)
    with pytest.raises(UserError, match=r"is as it was"):
        preprocess(CriteoConfig(input=str(raw), output=str(out), progress=False))
    assert len(calls) == 3
    assert files_of(out) == before
    assert not (out / "train").exists() and not (out / "val").exists()  # no folder made for the new shards
    assert not list(tmp_path.glob("ds.*"))


def test_preprocess_refuses_an_input_inside_the_output(tmp_path):
    raw = tmp_path / "raw.tsv"
    raw.write_text(criteo_lines(300))
    r = recsys("preprocess", "criteo", f"input={raw}", "output=ds", "progress=false", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    inside = tmp_path / "ds" / "raw.tsv"
    inside.write_text(criteo_lines(300, seed=2))
    before = files_of(tmp_path / "ds")
    r = recsys("preprocess", "criteo", f"input={inside}", "output=ds", "progress=false", cwd=tmp_path)
    assert_user_error(r, str(inside), "inside the output directory ds")
    assert files_of(tmp_path / "ds") == before


# --- 4. one run per run directory ----------------------------------------------------------------------------------


def test_a_second_run_in_a_busy_run_directory_fails_and_leaves_it_alone(tmp_path, train):
    from recsys_cli.train import rundir

    data = tiny_dataset(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # the running run's files
    with rundir.locked(run):  # a run holds the directory
        r = train(f"dataset.path={data}", *TINY_TRAIN, "hydra.run.dir=run")
        assert_user_error(r, f"run directory {run}", f"in use by another recsys train (pid {os.getpid()})")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (run / ".hydra").exists() and not (run / "summary.json").exists()
    assert not (run / "checkpoints").exists()


def test_a_lock_left_by_a_dead_run_is_stale(tmp_path, train):
    data = tiny_dataset(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").write_text(dead.stdout)  # the lock file of a run that was killed
    r = train(f"dataset.path={data}", *TINY_TRAIN, "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 6
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    assert not (tmp_path / "run" / ".lock").exists()  # taken over, and removed when the run ended


def test_a_second_run_into_a_finished_run_directory_is_refused_and_changes_nothing(tmp_path, train):
    """hydra.run.dir=run twice, no resume: the second run replaced the first one's
    checkpoints and metrics.jsonl without a word (issue 27)."""
    data = tiny_dataset(tmp_path)
    r = train(f"dataset.path={data}", *TINY_TRAIN, "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    before = files_of(run)
    assert ".lock" not in before  # removed when the run ended (locks.py)
    assert "metrics.jsonl" in before and "checkpoints/latest.json" in before
    r = train(f"dataset.path={data}", *TINY_TRAIN, "trainer.seed=1", "hydra.run.dir=run")
    assert_user_error(r, f"run directory {run} holds another run (metrics.jsonl, summary.json, checkpoints/)",
                      "resume it with trainer.resume=true, or choose another directory")
    after = files_of(run)
    assert after == before
    # Its checkpoint directory, given to a new run elsewhere, is refused as well.
    r = train(f"dataset.path={data}", *TINY_TRAIN, f"trainer.checkpoint_dir={run / 'checkpoints'}",
              "hydra.run.dir=other")
    assert_user_error(r, f"checkpoint directory {run / 'checkpoints'} holds another run's checkpoints")
    after = files_of(run)
    assert after == before  # the refused run held the checkpoint directory while it checked, and left no lock and not (tmp_path / "other" / "metrics.jsonl").exists()


def test_a_resume_of_another_runs_checkpoint_into_a_finished_run_directory_is_refused(tmp_path, train):
    """trainer.resume=RUN_A's checkpoint with hydra.run.dir=RUN_B (a finished
    run) wrote A's history over B's metrics.jsonl and summary.json, and A's
    checkpoint of a step over B's of the same step, without a word."""
    data = tiny_dataset(tmp_path)
    for run, seed in (("a", 0), ("b", 1)):
        r = train(f"dataset.path={data}", *TINY_TRAIN, f"trainer.seed={seed}", f"hydra.run.dir={run}")
        assert r.returncode == 0, r.stderr
    b = tmp_path / "b"
    before = files_of(b)
    r = train(f"dataset.path={data}", *TINY_TRAIN, f"trainer.resume={tmp_path / 'a' / 'checkpoints'}",
              "trainer.max_steps=8", "hydra.run.dir=b")
    assert_user_error(r, f"run directory {b} holds another run (metrics.jsonl, summary.json, checkpoints/)",
                      str(tmp_path / "a" / "checkpoints" / "step-00000006.pt"), "nothing was changed")
    assert files_of(b) == before
    # In place (its own checkpoint, by path or as the latest) and into a new directory, it resumes.
    for args in ([f"trainer.resume={b / 'checkpoints' / 'step-00000006.pt'}", "hydra.run.dir=b"],
                 ["trainer.resume=true", "trainer.max_steps=10", "hydra.run.dir=b"],
                 [f"trainer.resume={tmp_path / 'a' / 'checkpoints'}", "hydra.run.dir=c"]):
        r = train(f"dataset.path={data}", *TINY_TRAIN, "trainer.max_steps=8", *args)
        assert r.returncode == 0, r.stderr
        assert "resumed from" in r.stdout
    # The check finds the checkpoint quietly: a damaged latest.json is one warning, the trainer's.
    (b / "checkpoints" / "latest.json").write_text('{"fi')
    r = train(f"dataset.path={data}", *TINY_TRAIN, "trainer.max_steps=12", "trainer.resume=true", "hydra.run.dir=b")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("latest.json is damaged") == 1, r.stderr


def test_a_failed_start_removes_the_run_directories_it_created_and_nothing_else(tmp_path, train):
    """A start that fails before any output (here: no dataset) left an empty
    outputs/DATE/TIME/ (its lock, .hydra/, an empty app.log) per attempt (issue 28)."""
    missing = ["dataset=criteo_kaggle", f"dataset.path={tmp_path / 'nope'}", "trainer.progress=false"]
    r = train(*missing)
    assert_user_error(r, "does not exist")
    assert not (tmp_path / "outputs").exists()  # outputs/, its DATE/ and TIME/ were all made by this start
    # A directory that was there before stays: another run's, and one named with hydra.run.dir.
    other = tmp_path / "outputs" / "2026-01-01" / "10-00-00"
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "mine").mkdir()
    assert_user_error(train(*missing), "does not exist")
    assert_user_error(train(*missing, "hydra.run.dir=mine"), "does not exist")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "outputs").rglob("*")) == [
        "outputs/2026-01-01", "outputs/2026-01-01/10-00-00", "outputs/2026-01-01/10-00-00/metrics.jsonl"]
    assert (tmp_path / "mine").is_dir()
    # hydra.run.dir naming directories that do not exist yet: they are this start's.
    assert_user_error(train(*missing, "hydra.run.dir=new/run"), "does not exist")
    assert not (tmp_path / "new").exists()


# --- 6. metrics.jsonl after a resume ---------------------------------------------------------------------------------


def records(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        r.pop("samples_per_second", None)  # timing
        r.pop("phase_seconds", None)  # timing
        out.append(r)
    return out


class Killed(Exception):
    pass


def test_resume_rewinds_metrics_to_the_checkpoint(tmp_path, monkeypatch):
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path)
    common = dict(dataset__path=str(data), trainer__batch_size=50, trainer__epochs=3, trainer__log_every=4,
                  trainer__eval_every=6, trainer__checkpoint_every=10)
    Trainer(config(tmp_path, optimizer__lr=LR, **common), run_dir=tmp_path / "full").fit()

    step = Trainer.train_step

    def dies_after_step_25(self, batch):
        if self.step == 25:
            raise Killed  # as if killed: checkpoint at 20, metrics written up to 20 plus the records of step 24
        return step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", dies_after_step_25)
    with pytest.raises(Killed):
        Trainer(config(tmp_path, optimizer__lr=LR, **common), run_dir=tmp_path / "run").fit()
    assert max(r["step"] for r in records(tmp_path / "run")) > 20
    monkeypatch.setattr(Trainer, "train_step", step)
    Trainer(config(tmp_path, optimizer__lr=LR, **common, trainer__resume="true"), run_dir=tmp_path / "run").fit()
    assert records(tmp_path / "run") == records(tmp_path / "full")
    assert not list((tmp_path / "run").glob("*.tmp"))


# --- 5. resume into a different model ----------------------------------------------------------------------------


def test_resume_into_another_model_names_the_keys_and_changes_nothing(tmp_path, train):
    data = tiny_dataset(tmp_path)
    r = train(f"dataset.path={data}", *TINY_TRAIN, "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    ck = tmp_path / "run" / "checkpoints"
    before = files_of(ck)
    r = train(f"dataset.path={data}", *TINY_TRAIN, "trainer.resume=true", "hydra.run.dir=run2",
              f"trainer.checkpoint_dir={ck}", "model.embedding_dim=8", "model.bottom_mlp=[64,8]",
               "model.interaction=cat")
    line = assert_user_error(r, str(ck / "step-00000006.pt"), "model.embedding_dim=16 in the checkpoint, 8 now",
                             "model.bottom_mlp=[64, 16] in the checkpoint, [64, 8] now", "model.interaction")
    assert "placement.*" in line  # says what may change
    after = files_of(ck)
    assert after == before  # the second run held the checkpoint directory while it checked, and left no lock
    # What may change does: placement, precision, trainer.* keys.
    r = train(f"dataset.path={data}", *TINY_TRAIN, "trainer.max_steps=10", "trainer.resume=true",
              "+placement=lookahead", "placement.cache_rows=800", "+precision=int8", "hydra.run.dir=run3",
               f"trainer.checkpoint_dir={ck}")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert json.loads((tmp_path / "run3" / "summary.json").read_text())["steps"] == 10


# --- 2. corrupt shards ---------------------------------------------------------------------------------------------


def damage(path: Path, at: float = 0.5) -> None:
    """Flip a run of bytes inside the file (its size stays)."""
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i : i + 64] = bytes(b ^ 0x5A for b in data[i : i + 64])
    path.write_bytes(bytes(data))


def test_a_damaged_train_shard_is_named_by_its_checksum(tmp_path, train):
    data = tiny_dataset(tmp_path)
    damage(data / "train-00001.parquet")
    r = train(f"dataset.path={data}", *TINY_TRAIN, "trainer.max_steps=12", "hydra.run.dir=run")
    assert_user_error(r, str(data / "train-00001.parquet"), "sha256", "recsys verify")
    r = recsys("verify", data, cwd=tmp_path)
    assert_user_error(r, "train-00001.parquet: sha256 differs")


def test_a_truncated_shard_fails_at_start(tmp_path):
    data = tiny_dataset(tmp_path)
    shard = data / "test-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:-100])
    r = recsys("train", f"dataset.path={data}", *TINY_TRAIN, "hydra.run.dir=run", cwd=tmp_path)
    assert_user_error(r, str(shard), "bytes, the manifest says")
    assert not (tmp_path / "run" / "checkpoints").exists()  # before any training


def test_an_unreadable_val_shard_keeps_the_trained_model(tmp_path, train):
    data = tiny_dataset(tmp_path)
    shard = data / "val-00000.parquet"
    damage(shard, at=0.3)
    m = json.loads((data / MANIFEST_NAME).read_text())
    m["splits"]["val"]["shards"][0]["sha256"] = ""  # a dataset without checksums: the read itself fails
    (data / MANIFEST_NAME).write_text(json.dumps(m))
    r = train(f"dataset.path={data}", *TINY_TRAIN, "hydra.run.dir=run")
    assert_user_error(r, str(shard), "row group 0 cannot be read")
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 6  # the final checkpoint was written before the final evaluation


def test_verify_accepts_a_good_dataset(tmp_path):
    data = tiny_dataset(tmp_path)
    r = recsys("verify", data, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ok:" in r.stdout and "4 shards" in r.stdout


# --- 8. small lies in messages -------------------------------------------------------------------------------------


def test_nan_loss_without_a_checkpoint_says_none_was_written(tmp_path):
    from recsys_cli.errors import UserError
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path)
    cfg = config(tmp_path, dataset__path=str(data), trainer__batch_size=50, optimizer__lr=1e12, trainer__log_every=1)
    with pytest.raises(UserError, match=r"loss is nan at step \d+ .*; no checkpoint was written"):
        Trainer(cfg).fit()
    cfg = config(tmp_path, dataset__path=str(data), trainer__batch_size=50, optimizer__lr=1e12, trainer__log_every=1,
                 trainer__checkpoint_every=1, trainer__checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(UserError, match=r"the last good checkpoint \(step \d+\) is in .*ck: resume with"):
        Trainer(cfg).fit()


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_unlabelled_input_says_it_looks_unlabelled(tmp_path, on_error, capsys, monkeypatch):
    raw = tmp_path / "test.txt"
    raw.write_text(criteo_lines(50, columns=39))
    monkeypatch.chdir(tmp_path)  # main() here (preprocess composes without Hydra's global state): the line
    monkeypatch.setenv("COLUMNS", "200")
    r = completed_in_process(["preprocess", "criteo", f"input={raw}", "output=ds", f"on_error={on_error}",
                              "progress=false"], capsys)
    line = assert_user_error(r, f"{raw} line 1", "found 39", "looks unlabelled", "needs the label")
    assert "on_error=skip drops" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.txt"]


@pytest.mark.parametrize("override, needle", [
    ("trainer.batchsize=3", "unknown key 'trainer.batchsize'"),
    ("+trainer.batchsize=3", "unknown key 'trainer.batchsize'"),
    ("+placement=lookahead placement.polcy=lru", "unknown key 'placement.polcy'"),
    ("+placement=lookahead placement.policy=fifo", "placement.policy='fifo' is not one of lru, lfu"),
    ("+placement=nowhere", "Could not find 'placement/nowhere' (options: auto, cache"),
    ("trainer.batch_size=many", "bad value for 'trainer.batch_size'"),
    ("trainer.max_steps=[1", "cannot parse the override"),
])
def test_config_errors_exit_2_on_one_line(tmp_path, monkeypatch, capsys, override, needle):
    """Found before Hydra starts (and before torch loads, tests/test_run_log.py):
    main() in this process, as the entry point calls it."""
    monkeypatch.chdir(tmp_path)
    code, stderr = in_process(["train", *override.split(), "hydra.run.dir=run"], capsys)
    assert_user_error(subprocess.CompletedProcess([], code, "", stderr), "bad configuration", needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sweep, needle", [
    ("+optimizer.lrr=0.05,0.1", "bad configuration: unknown key 'optimizer.lrr' (job #0 of the sweep: "
                                "+optimizer.lrr=0.05)"),
    ("optimizer.lrr=0.05,0.1", "bad configuration: unknown key 'optimizer.lrr' (job #0"),
    ("placement=lookahed,device", "Could not find 'placement/lookahed' (options: auto, cache"),
    ("optimizer.lr=0.05,-1", "optimizer.lr must be > 0, got -1.0 (job #1 of the sweep: optimizer.lr=-1)"),
    ("optimizer.lr=choice(0.05,0.1) trainer.batch_size=range(64,-64,-64)",
     "trainer.batch_size must be >= 1, got 0 (job #1 of the sweep: optimizer.lr=0.05 trainer.batch_size=0)"),
])
def test_every_job_of_a_sweep_is_checked_before_the_first_starts(tmp_path, monkeypatch, capsys, sweep, needle):
    """`-m` with comma lists, choice() or range(): each job is composed and
    checked as a single run is, before Hydra starts (a sweep's first jobs
    used to train, unknown keys stored, Hydra's reports printed): one line
    naming the key and the job's sweep values, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    code, stderr = in_process(["train", "-m", *sweep.split(), "dataset.synthetic.rows=2000", "hydra.sweep.dir=multi"],
                              capsys)
    assert_user_error(subprocess.CompletedProcess([], code, "", stderr), needle)
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_without_multirun_is_one_line(tmp_path, monkeypatch, capsys):
    """Hydra's report of a comma list without -m was five lines ("Ambiguous value")."""
    monkeypatch.chdir(tmp_path)
    code, stderr = in_process(["train", "optimizer.lr=0.05,0.1", "dataset.synthetic.rows=2000"], capsys)
    assert_user_error(subprocess.CompletedProcess([], code, "", stderr),
                      "optimizer.lr=0.05,0.1 is a sweep: run it with -m")
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_with_a_bad_value_trains_no_job(tmp_path):
    """The real process: exit 2 before the sweep directory, the data or a job's run exists."""
    r = recsys("train", "-m", "optimizer.lr=0.05,-1", "dataset.synthetic.rows=2000", "trainer.max_steps=2", cwd=tmp_path)
    assert_user_error(r, "optimizer.lr must be > 0, got -1.0 (job #1 of the sweep: optimizer.lr=-1)")
    assert list(tmp_path.iterdir()) == []


def test_hydras_own_keys_exit_2(tmp_path):
    r = recsys("train", "hydra.nokey=1", "hydra.run.dir=run", cwd=tmp_path)
    assert r.returncode == 2 and "nokey" in r.stderr, r.stderr  # Hydra's own report, but exit 2 too
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("trainer.loader_queue_depth=0", "trainer.loader_queue_depth must be >= 1, got 0"),  # was a ValueError traceback
    ("optimizer.lr=inf", "optimizer.lr must be > 0, got inf"),  # a non-finite rate: refused before any step
    ("optimizer.lr=nan", "optimizer.lr must be > 0, got nan"),
    ("optimizer.lr=0", "optimizer.lr must be > 0, got 0"),
    # found by the ranks after they had started (a user test): now before any process or data
    ("trainer.embedding_sync=cache_avg", "cache_avg averages cache rows, but placement.kind=device puts no table"),
    ("trainer.embedding_sync=cache_avg placement=lookahead precision=int8",
     "cache_avg needs fp32 tables behind the cache, not precision.kind=int8"),
])
def test_bad_numbers_exit_2_on_one_line_before_training(tmp_path, override, message, train):
    r = train(*override.split(), "trainer.progress=false", "hydra.run.dir=run")
    assert_user_error(r, message)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "cache").exists()  # no data generated


def test_a_train_split_smaller_than_one_batch_is_one_line_before_the_run_directory(tmp_path, train):
    """A 10-row train split at the default trainer.batch_size=256 was the
    loader's ValueError as a traceback, exit 1, after the run directory was made."""
    data = write_dataset(tmp_path, {"train": 10, "val": 5, "test": 5})
    r = train(f"dataset.path={data}", "trainer.progress=false", "hydra.run.dir=run")
    assert_user_error(r, f"split 'train' of {data} has 10 rows, fewer than one global batch of trainer.batch_size=256",
                      "lower trainer.batch_size", "trainer.drop_last=false")
    assert not (tmp_path / "run").exists()
    # placement=auto samples its batches as the run trains them: the one partial batch with drop_last=false
    r = train(f"dataset.path={data}", "trainer.drop_last=false", "placement=auto", "trainer.progress=false",
              f"optimizer.lr={LR}", "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "summary.json").exists()


# --- 9. dedup on a dataset without sessions ------------------------------------------------------------------------


def test_dedup_without_sessions_dedups_in_batch_and_says_so(tmp_path):
    from recsys_cli.errors import UserError
    from recsys_cli.train.progress import summary_table
    from recsys_cli.train.trainer import Trainer
    from rich.console import Console

    data = tiny_dataset(tmp_path, multihot=1, vocab=20)  # ids repeat within a batch
    common = dict(dataset__path=str(data), trainer__batch_size=50, trainer__max_steps=10)
    runs = {}
    for enabled in (False, True):
        t = Trainer(config(tmp_path, optimizer__lr=LR, **common, dedup__enabled=enabled))
        t.record_losses = True
        runs[enabled] = (t, t.fit())
    (off, _), (on, summary) = runs[False], runs[True]
    torch.testing.assert_close(torch.tensor(on.step_losses), torch.tensor(off.step_losses), rtol=1e-6, atol=0)
    assert summary["dedup"] and summary["session_shuffle"] is False
    assert summary["duplication"]["lookups_saved_by_dedup"] > 0
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    assert "shuffled samples (no session column)" in console.export_text()
    with pytest.raises(UserError, match="dedup.keep_sessions=true but .* names no session column .*dataset=synthetic_sessions"):
        Trainer(config(tmp_path, optimizer__lr=LR, **common, dedup__enabled=True, dedup__keep_sessions=True))


def test_dedup_with_sessions_turned_off_says_so_not_no_session_column(tmp_path):
    """dataset=synthetic_sessions dedup=on dedup.keep_sessions=false said
    "shuffled samples (no session column)": the dataset has one, the user
    turned session-keeping off."""
    from recsys_cli.train.progress import summary_table
    from recsys_cli.train.trainer import Trainer
    from rich.console import Console

    data = tiny_dataset(tmp_path, multihot=1, vocab=20, sessions=True)
    summary = Trainer(config(tmp_path, optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50,
                             trainer__max_steps=2, dedup__enabled=True, dedup__keep_sessions=False)).fit()
    assert summary["session_shuffle"] is False and summary["session_column"]
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "shuffled samples (sessions not kept: dedup.keep_sessions=false)" in text
    assert "no session column" not in text


def test_cli_dedup_on_data_without_sessions(tmp_path, train):
    data = tiny_dataset(tmp_path, multihot=1, vocab=20)  # like the default dataset: no session column
    r = train("+dedup=on", f"dataset.path={data}", *TINY_TRAIN, "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    assert "no session column" in r.stdout


# --- 7. disk full --------------------------------------------------------------------------------------------------


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_preprocess_checks_free_space_before_the_spill(tmp_path, monkeypatch):
    import shutil as shutil_module

    from data_tools import criteo
    from recsys_cli.errors import UserError

    raw = tmp_path / "raw.tsv"
    raw.write_text(criteo_lines(300))
    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: real(p)._replace(free=10_000))
    with pytest.raises(UserError, match=r"pass 1 spills about 0.0 GB \(300 rows x 160 bytes\) to .*ds.tmp-\d+, but "
                                        r"only 0.0 GB are free there; free space or give spill=false"):
        criteo.preprocess(criteo.CriteoConfig(input=str(raw), output=str(tmp_path / "ds"), progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.tsv"]
    criteo.preprocess(criteo.CriteoConfig(input=str(raw), output=str(tmp_path / "ds"), progress=False, spill=False))


@pytest.mark.parametrize("spill", [True, False])
def test_disk_full_in_preprocess_leaves_the_old_dataset(tmp_path, monkeypatch, spill):
    from data_tools import criteo
    from data_tools import shards as sh
    from recsys_cli.errors import UserError

    raw = tmp_path / "raw.tsv"
    raw.write_text(criteo_lines(300))
    out = tmp_path / "ds"
    criteo.preprocess(criteo.CriteoConfig(input=str(raw), output=str(out), progress=False))
    before = files_of(out)
    monkeypatch.setattr(sh.ShardWriter, "_write_group", enospc)
    with pytest.raises(UserError, match=rf"cannot write the dataset {out} \(built in .*\): no space left on device; "
                                        rf"{out} is as it was"):
        criteo.preprocess(criteo.CriteoConfig(input=str(raw), output=str(out), progress=False, spill=spill))
    assert files_of(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "raw.tsv"]


class FillsUp:
    """A checkpoint file whose disk fills up after `room` bytes: writes past
    them raise ENOSPC, as a full disk's write does, under torch's own writer."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        if self.f.tell() + len(data) > self.room:
            self.f.write(bytes(data)[: max(0, self.room - self.f.tell())])
            enospc()
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_disk_full_at_a_checkpoint_keeps_the_last_good_one(tmp_path, monkeypatch):
    """torch.save into a full disk raises RuntimeError, not OSError: it was a
    traceback (exit 1) and left the .tmp file on the full disk (issue 27)."""
    import builtins

    from recsys_cli.checkpoints import write as checkpoint
    from recsys_cli.errors import UserError
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path)
    ck = tmp_path / "ck"
    real_open = builtins.open
    opened = []

    def open_on_a_filling_disk(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if str(file).endswith(".pt.tmp"):
            opened.append(file)
            if len(opened) == 2:  # the second checkpoint: the disk fills 1 KiB into it
                return FillsUp(f, 1024)
        return f

    monkeypatch.setattr(checkpoint, "open", open_on_a_filling_disk, raising=False)
    cfg = config(tmp_path, optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50, trainer__max_steps=8,
                 trainer__checkpoint_every=4, trainer__checkpoint_dir=str(ck))
    with pytest.raises(UserError) as error:
        Trainer(cfg, run_dir=tmp_path / "run").fit()
    first_size = (ck / "step-00000004.pt").stat().st_size
    message = str(error.value)
    assert message.startswith(f"cannot write {ck}/step-00000008.pt: no space left on device; a checkpoint needs about "
                              f"{first_size / 2**20:,.1f} MiB in {ck} (")
    assert message.endswith(f"MiB free); the last good checkpoint, {ck}/step-00000004.pt, is kept")
    assert "\n" not in message
    # no .tmp left; the record of step 4's files (checksums) stays with it
    assert sorted(p.name for p in ck.iterdir()) == ["latest.json", "step-00000004.files.json", "step-00000004.pt"]
    assert json.loads((ck / "latest.json").read_text())["step"] == 4
    torch.load(ck / "step-00000004.pt", weights_only=False)  # whole


FULL_AT_THE_SECOND_CHECKPOINT = """
import resource, signal, sys
sys.argv = ["recsys", "train", *sys.argv[1:]]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the file-size limit a write fails, as on a full disk
from recsys_cli import checkpoints as checkpoint
save = checkpoint.save_checkpoint
def save_on_a_filling_disk(directory, step, state, *args, **kwargs):
    if step > 4:  # the disk fills: no file may grow past 4 KiB from now on
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 12, resource.RLIM_INFINITY))
    return save(directory, step, state, *args, **kwargs)
checkpoint.save_checkpoint = save_on_a_filling_disk
from recsys_cli.cli import main
main()
"""


def test_a_failed_checkpoint_write_is_one_line_exit_2_and_leaves_no_tmp(tmp_path):
    """A real failed write (the kernel refuses it: a file-size limit) at the second
    checkpoint of a CLI run: one line naming the file and the space, exit 2."""
    data = tiny_dataset(tmp_path)
    r = subprocess.run([sys.executable, "-c", FULL_AT_THE_SECOND_CHECKPOINT, f"dataset.path={data}", *TINY_TRAIN,
                        "trainer.max_steps=8", "trainer.checkpoint_every=4", "hydra.run.dir=run"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    ck = tmp_path / "run" / "checkpoints"
    line = assert_user_error(r, f"cannot write {ck / 'step-00000008.pt'}: File too large; a checkpoint needs about",
                             f"the last good checkpoint, {ck / 'step-00000004.pt'}, is kept")
    assert "Error executing job" not in r.stderr, line
    assert sorted(p.name for p in ck.iterdir()) == ["latest.json", "step-00000004.files.json", "step-00000004.pt"]
    assert json.loads((ck / "latest.json").read_text())["step"] == 4


def test_a_damaged_latest_json_falls_back_to_the_newest_checkpoint(tmp_path, capsys):
    """A truncated latest.json was a JSONDecodeError traceback on resume (issue 27)."""
    from recsys_cli.errors import UserError
    from recsys_cli import checkpoints as checkpoint
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path)
    ck = tmp_path / "ck"
    common = dict(optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50, trainer__checkpoint_every=4,
                  trainer__checkpoint_dir=str(ck))
    Trainer(config(tmp_path, trainer__max_steps=8, **common), run_dir=tmp_path / "run").fit()
    full = Trainer(config(tmp_path, trainer__max_steps=10, **{**common, "trainer__checkpoint_dir": str(tmp_path / "ck2")}),
                   run_dir=tmp_path / "run_full")  # the uninterrupted run
    full.fit()
    latest = ck / "latest.json"
    latest.write_text(latest.read_text()[:9])  # truncated
    capsys.readouterr()
    assert checkpoint.find_checkpoint(ck) == ck / "step-00000008.pt"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: {latest} is damaged; using the newest complete "
                                                    f"checkpoint, {ck / 'step-00000008.pt'}")
    resumed = Trainer(config(tmp_path, trainer__max_steps=10, trainer__resume="true", **common), run_dir=tmp_path / "run")
    assert resumed.step == 8
    resumed.fit()
    for k, v in full.model.state_dict().items():  # the resumed run ends where the uninterrupted one does
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    # No complete checkpoint beside it: one line naming the file.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "latest.json").write_text('{"fi')
    with pytest.raises(UserError, match=rf"^{tmp_path / 'empty' / 'latest.json'} is damaged, and "
                                        rf"{tmp_path / 'empty'} holds no other checkpoint \(step-\*\.pt\)$"):
        checkpoint.find_checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("name", ["../other/step-00000004.pt", "OTHER", "step-00000004.pt"])
def test_a_latest_json_naming_a_file_out_of_its_directory_is_damaged(tmp_path, capsys, name):
    """latest.json is a file like any other: one that names another
    directory's checkpoint ("../other/...", an absolute path) took a resume
    there; one whose file is not its step's was followed too. Either is
    damaged: the newest complete checkpoint beside it is used, with a warning."""
    from recsys_cli import checkpoints as checkpoint
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path)
    for ck, steps in (("ck", 8), ("other", 4)):
        Trainer(config(tmp_path, optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50,
                       trainer__max_steps=steps, trainer__checkpoint_dir=str(tmp_path / ck)),
                run_dir=tmp_path / f"run-{ck}").fit()
    latest = tmp_path / "ck" / "latest.json"
    name = str(tmp_path / "other" / "step-00000004.pt") if name == "OTHER" else name
    latest.write_text(json.dumps({"file": name, "step": 8}))
    capsys.readouterr()
    assert checkpoint.find_checkpoint(tmp_path / "ck") == tmp_path / "ck" / "step-00000008.pt"
    assert capsys.readouterr().err.startswith(f"warning: {latest} is damaged; using the newest complete checkpoint")


@pytest.mark.parametrize("best", ['[1]', '{"file": "step-0000001x.pt"}', '{"file": 5}'])
def test_a_damaged_best_json_is_named_again_on_resume(tmp_path, best):
    """best.json whose "file" was not a checkpoint's name, or not a mapping,
    made a keep_best resume fail with a traceback (ValueError: invalid literal
    for int()); the resume names the best checkpoint again (its loop state knows it)."""
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path)
    ck = tmp_path / "ck"
    common = dict(optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50, trainer__checkpoint_every=4,
                  trainer__eval_every=4, trainer__keep_best=True, trainer__checkpoint_dir=str(ck))
    Trainer(config(tmp_path, trainer__max_steps=8, **common), run_dir=tmp_path / "run").fit()
    named = json.loads((ck / "best.json").read_text())
    (ck / "best.json").write_text(best)
    resumed = Trainer(config(tmp_path, trainer__max_steps=10, trainer__resume="true", **common), run_dir=tmp_path / "run")
    assert json.loads((ck / "best.json").read_text()) == named
    resumed.fit()


def test_disk_full_in_metrics_leaves_whole_lines(tmp_path, monkeypatch):
    from recsys_cli.errors import UserError
    from recsys_cli.train import metrics
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path)
    real = os.write
    calls = []

    def half_then_full(fd, data):
        calls.append(fd)
        if len(calls) == 3:
            real(fd, data[: len(data) // 2])
            enospc()
        return real(fd, data)

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    cfg = config(tmp_path, optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50, trainer__max_steps=10,
                 trainer__log_every=2)
    with pytest.raises(UserError, match=rf"cannot write {tmp_path / 'run' / 'metrics.jsonl'}: no space left on device"):
        Trainer(cfg, run_dir=tmp_path / "run").fit()
    monkeypatch.undo()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]


# --- 10. distributed checkpoints ---------------------------------------------------------------------------------


def slow_checkpoint_run(container: dict, sleep_s: float) -> dict | None:
    """A worker whose rank 0 takes `sleep_s` longer to write each checkpoint
    (as a save of large host tables does)."""
    import time

    from omegaconf import OmegaConf

    from recsys_cli.config import TrainConfig
    from recsys_cli import checkpoints as checkpoint
    from recsys_cli.train import distributed
    from recsys_cli.train.trainer import Trainer

    real = checkpoint.save_checkpoint

    def slow(*args, **kwargs):
        time.sleep(sleep_s)
        return real(*args, **kwargs)

    checkpoint.save_checkpoint = slow
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), container)
    ctx = distributed.init(timeout_s=cfg.trainer.dist_timeout, device="cpu")
    trainer = Trainer(cfg)
    trainer.fit()
    distributed.teardown()
    return {"step": trainer.step} if ctx.is_main else None


@pytest.mark.slow
def test_ranks_wait_for_a_checkpoint_longer_than_the_step_timeout(tmp_path):
    from omegaconf import OmegaConf

    from recsys_cli.train import distributed

    data = tiny_dataset(tmp_path)
    # The step collectives' timeout: far above the ranks' start-up skew (about a
    # second, several on a loaded 2-core machine, where the 6 s this was left little room);
    # rank 0's checkpoint takes 5 s longer than it, which the checkpoint group outwaits.
    timeout = 12
    cfg = config(tmp_path, optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50, trainer__max_steps=8,
                 trainer__dist_timeout=timeout, trainer__checkpoint_dir=str(tmp_path / "ck"),
                 placement__kind="lookahead", placement__cache_rows=800)
    try:  # the final checkpoint, then the final evaluation's collectives
        out = distributed.launch(slow_checkpoint_run, 2, OmegaConf.to_container(cfg, resolve=True), timeout + 5)
    except distributed.WorkerFailed as e:
        pytest.fail(f"{e}\n{e.traceback}")
    assert out[0] == {"step": 8}
    assert json.loads((tmp_path / "ck" / "latest.json").read_text())["step"] == 8


def test_host_tables_are_checkpointed_without_a_copy(tmp_path):
    from recsys_cli.checkpoints import load_checkpoint
    from recsys_cli.train.trainer import Trainer

    data = tiny_dataset(tmp_path, vocab=20000)
    cfg = config(tmp_path, optimizer__lr=LR, dataset__path=str(data), trainer__batch_size=50, trainer__max_steps=4,
                 placement__kind="uvm", trainer__checkpoint_dir=str(tmp_path / "ck"))
    trainer = Trainer(cfg)
    trainer.fit()
    (group,) = trainer.embeddings.groups
    store = group.store.rows.tensors()["weights"]
    for tensors in trainer.embeddings.table_state().values():  # views of the host store, no copy
        assert tensors["weights"].untyped_storage().data_ptr() == store.untyped_storage().data_ptr()
    table_bytes = store.numel() * store.element_size()
    path = tmp_path / "ck" / "step-00000004.pt"
    assert table_bytes < path.stat().st_size < 1.1 * table_bytes + 200_000  # the fused storage once
    saved = load_checkpoint(path)["tables"]
    for name, tensors in trainer.embeddings.table_state().items():
        assert torch.equal(saved[name]["weights"], tensors["weights"])
