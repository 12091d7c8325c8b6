"""No file recsys reads can run code (issue 40 item 1).

A planted `__reduce__` that would run `touch MARKER` through os.system, in
a checkpoint's .pt, in a sharded checkpoint's shard file (caches-0.pt) and
in its DCP index (.metadata), each with every checksum that covers it
rewritten to match (anyone can compute XXH3), is refused on every path that
reads it (resume, init_from, predict, evaluate, export, the sharded resume's
caches, `recsys verify`) in one line naming the file, and the marker is
never created. One small run is the fixture of them all; its sharded twin
is its tables saved as shards by one process (save_shards, no process
group), which every one-process reader assembles whole."""

from __future__ import annotations

import enum
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from datasets import write_dataset
from test_bad_input import LR, assert_user_error, recsys
from train_config import config

from recsys_cli import safe_load
from recsys_cli.checksum import Checksum
from recsys_cli.errors import UserError
from recsys_cli import checkpoints as ckpt
from recsys_cli import checkpoints as sc
from recsys_cli.checkpoints import layout, reshard
from recsys_cli.checkpoints.record import read_record, write_record
from recsys_cli.checkpoints.verify import checkpoint_problems
from recsys_cli.verify import run_verify

STEP = 4
STEPS = dict(trainer__batch_size=50, optimizer__lr=LR, trainer__device="cpu")


class Plant:
    """Unpickled by anything that runs what a file says, it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run (its checkpoint at step 4) and its sharded twin: (tmp, dataset, run dir, sharded dir)."""
    from recsys_cli.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("safe_load")
    data = write_dataset(tmp, {"train": 400, "val": 100, "test": 100})
    cfg = config(tmp / "cache", dataset__path=str(data), trainer__max_steps=STEP,
                 trainer__checkpoint_dir=str(tmp / "run" / "checkpoints"), **STEPS)
    Trainer(cfg, run_dir=tmp / "run").fit()
    state = ckpt.load_checkpoint(tmp / "run" / "checkpoints" / ckpt.step_file(STEP), keep_patches=True)
    sharded = tmp / "sharded" / "checkpoints"
    directory = sc.shard_dir(sharded, STEP)
    pieces = {name: (0, entry["state"].shape[0], entry) for name, entry in state["tables"].items()}
    sc.save_shards(directory, pieces, state.get("caches"), 0, 1)
    ckpt.save_checkpoint(sharded, STEP, {**state, "tables": sc.tables_reference(directory, {"world_size": 1})})
    return tmp, data, tmp / "run", tmp / "sharded"


def _record_of(data: bytes) -> dict:
    c = Checksum()
    c.update(data)
    return c.record()


def _rewrite(path: Path, data: bytes, checkpoint: Path) -> None:
    """Write `data` to `path` and make every checksum that covers it match:
    the checkpoint's record, and for a shard file its manifest (and the
    manifest's own line and record entry)."""
    path.write_bytes(data)
    files = read_record(checkpoint)
    assert files is not None
    if path.parent == checkpoint.parent:
        files[path.name] = _record_of(data)
    else:
        directory = path.parent
        manifest = layout.read_manifest(directory)
        manifest["files"][path.name] = _record_of(data)
        layout.write_manifest(directory / sc.MANIFEST, manifest)
        files[f"{directory.name}/{path.name}"] = _record_of(data)
        files[f"{directory.name}/{sc.MANIFEST}"] = _record_of((directory / sc.MANIFEST).read_bytes())
    write_record(checkpoint, files)  # type: ignore[arg-type]


def planted(run, tmp_path: Path, where: str) -> tuple[Path, Path, Path]:
    """A copy of the run (plain, or the sharded twin) with the payload in one
    file, every checksum rewritten: (run dir, the planted file, the marker)."""
    _, _, plain_run, sharded_run = run
    copy = tmp_path / "run"
    shutil.copytree(plain_run if where == "pt" else sharded_run, copy)
    marker = tmp_path / "MARKER"
    checkpoint = copy / "checkpoints" / ckpt.step_file(STEP)
    if where == "pt":
        state = torch.load(checkpoint, weights_only=True)
        state["note"] = Plant(marker)
        buf = io.BytesIO()
        torch.save(state, buf)
        path, data = checkpoint, buf.getvalue()
    elif where == "shard file":
        path = sc.shard_dir_of(checkpoint) / "caches-0.pt"
        saved = torch.load(path, weights_only=True)
        saved["caches"] = [Plant(marker), *saved["caches"]]
        buf = io.BytesIO()
        torch.save(saved, buf)
        data = buf.getvalue()
    else:  # DCP's index
        path = sc.shard_dir_of(checkpoint) / sc.METADATA
        metadata = pickle.loads(path.read_bytes())
        metadata.planner_data = Plant(marker)
        data = pickle.dumps(metadata)
    _rewrite(path, data, checkpoint)
    assert not checkpoint_problems(checkpoint)  # every checksum matches: only the loader can stop it
    return copy, path, marker


WHERE = ["pt", "shard file", "shard index"]


def readers(run, copy: Path, tmp_path: Path) -> dict:
    """Every in-process reader of a checkpoint, each given `copy`."""
    from recsys_cli.evaluate import EvaluateConfig, evaluate
    from recsys_cli.export import ExportConfig, export
    from recsys_cli.predict import PredictConfig, predict
    from recsys_cli.train.trainer import Trainer

    tmp, data = run[0], run[1]
    checkpoint = copy / "checkpoints" / ckpt.step_file(STEP)
    resume = config(tmp / "cache", dataset__path=str(data), trainer__max_steps=STEP + 2, trainer__resume="true",
                    trainer__checkpoint_dir=str(copy / "checkpoints"), **STEPS)
    init = config(tmp / "cache", dataset__path=str(data), trainer__max_steps=2,
                  trainer__init_from=str(copy / "checkpoints"), **STEPS)
    return {
        "resume": lambda: Trainer(resume, run_dir=copy),
        "init_from": lambda: Trainer(init, run_dir=tmp_path / "new"),
        "predict": lambda: predict(PredictConfig(checkpoint=str(copy), input=str(data), split="val", device="cpu",
                                                 output=str(tmp_path / "p.csv"), progress=False)),
        "evaluate": lambda: evaluate(EvaluateConfig(checkpoint=str(copy), split="val", device="cpu", plots=False,
                                                    output=str(tmp_path / "eval"), progress=False)),
        "export": lambda: export(ExportConfig(checkpoint=str(copy), output=str(tmp_path / "m.pt2"))),
        "verify": lambda: ckpt.unsafe_problems(checkpoint),
    }


def test_the_runs_load_safely(run, tmp_path):
    """Both fixtures load through every reader's path with nothing refused
    (so a refusal below is the payload's), and what recsys writes holds
    plain data only: torch.load(weights_only=True) reads it with no allowlist."""
    for directory in (run[2], run[3]):
        checkpoint = directory / "checkpoints" / ckpt.step_file(STEP)
        assert not checkpoint_problems(checkpoint) and not ckpt.unsafe_problems(checkpoint)
        torch.load(checkpoint, weights_only=True)
    shards = sc.shard_dir_of(run[3] / "checkpoints" / ckpt.step_file(STEP))
    torch.load(shards / "caches-0.pt", weights_only=True)
    assert set(sc.assemble_tables(shards)) == set(ckpt.load_checkpoint(run[2] / "checkpoints" /
                                                                       ckpt.step_file(STEP))["tables"])


@pytest.mark.parametrize("where", WHERE)
def test_a_planted_payload_is_refused_by_every_reader_and_never_runs(run, tmp_path, where):
    copy, path, marker = planted(run, tmp_path, where)
    what = {"pt": "checkpoint file", "shard file": "shard file", "shard index": "shard index"}[where]
    expected = f"refused {what} {path}: it holds posix.system, which is not plain data"
    calls = readers(run, copy, tmp_path)
    if where == "shard file":  # read only by a sharded resume on the world size that saved it
        calls = {"sharded resume": lambda: reshard.reader(path.parent).caches(0, 1), "verify": calls["verify"]}
    if where == "shard index":  # and by each rank of a sharded resume reading its own rows (re-sharding)
        calls["re-sharding"] = lambda: sc.load_shard(path.parent, "C1", 0, 1)
    for name, call in calls.items():
        if name == "verify":
            found = call()
            assert len(found) == 1 and found[0].startswith(expected), (name, found)
        else:
            with pytest.raises(UserError) as error:
                call()
            message = str(error.value)
            assert message.startswith(expected) and "\n" not in message, (name, message)
        assert not marker.exists(), f"{name} ran the planted command"
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "m.pt2").exists()


def test_the_command_line_refuses_in_one_line_and_runs_nothing(run, tmp_path):
    """The issue's case: `recsys evaluate checkpoint=RUN` of a planted .pt
    ran the command and printed metrics; now one line, exit 2, no traceback.
    `recsys verify` names a planted shard index without running it."""
    copy, path, marker = planted(run, tmp_path / "a", "pt")
    r = recsys("evaluate", f"checkpoint={copy}", "split=val", "device=cpu", "plots=false", "progress=false",
               f"output={tmp_path / 'eval'}", cwd=tmp_path)
    assert_user_error(r, f"refused checkpoint file {path}: it holds posix.system", safe_load.UPGRADE)
    copy, path, marker2 = planted(run, tmp_path / "b", "shard index")
    with pytest.raises(UserError) as error:  # `recsys verify RUN`, in process
        run_verify([str(copy)])
    assert str(error.value).startswith(f"refused shard index {path}: it holds posix.system"), str(error.value)
    assert str(error.value).endswith("1 problem(s) in 1 checkpoint(s) of " + str(copy / "checkpoints"))
    assert not marker.exists() and not marker2.exists()


def test_an_export_artifact_with_a_payload_is_refused(run, tmp_path):
    """A format=module scorer (a torch.save record) with the payload beside
    its state: load_scorer refuses it in one line naming it, and runs nothing;
    load_metadata reads a .pt2's metadata without torch.export.load (which
    would run what the program holds)."""
    from recsys_cli.export import ExportConfig, export, load_scorer

    artifact = tmp_path / "m.scorer.pt"
    export(ExportConfig(checkpoint=str(run[2]), format="module", output=str(artifact)))
    marker = tmp_path / "MARKER"
    record = torch.load(artifact, weights_only=True)
    torch.save({**record, "note": Plant(marker)}, artifact)
    with pytest.raises(safe_load.UnsafeFile, match=f"^refused export artifact {artifact}: it holds posix.system"):
        load_scorer(artifact)
    assert not marker.exists()


def test_an_older_checkpoint_with_config_enums_still_loads(run, tmp_path):
    """Checkpoints written before save_checkpoint made everything plain held
    recsys's config enums (PrecisionKind, Rounding) in disk tables' entries:
    they load (the allowlist), equal to the plain ones."""
    from recsys_cli.config import PrecisionKind, Rounding

    checkpoint = tmp_path / ckpt.step_file(STEP)
    state = torch.load(run[2] / "checkpoints" / ckpt.step_file(STEP), weights_only=True)
    state["tables_meta"] = {"precision": PrecisionKind.int8, "rounding": [Rounding.stochastic]}
    torch.save(state, checkpoint)
    loaded = safe_load.torch_file(checkpoint)
    assert loaded["tables_meta"] == {"precision": "int8", "rounding": ["stochastic"]}
    assert safe_load.plain(loaded["tables_meta"])["precision"].__class__ is str


def test_upgrade_converts_a_trusted_checkpoint_and_its_record(run, tmp_path):
    """What the refusal tells the owner of a trusted older checkpoint to run:
    the file is re-saved as plain data, its record rewritten, and it loads."""
    copy = tmp_path / "run"
    shutil.copytree(run[2], copy)
    checkpoint = copy / "checkpoints" / ckpt.step_file(STEP)
    state = torch.load(checkpoint, weights_only=True)
    state["extra"] = {"when": PlainEnum.old}  # an Enum outside the allowlist: refused until converted
    torch.save(state, checkpoint)
    _rewrite(checkpoint, checkpoint.read_bytes(), checkpoint)
    with pytest.raises(safe_load.UnsafeFile, match=f"refused checkpoint file {checkpoint}: it holds "
                                                   "test_safe_load.PlainEnum"):
        safe_load.torch_file(checkpoint)
    assert "converted to plain data (its record rewritten)" in safe_load.upgrade(checkpoint)
    assert ckpt.load_checkpoint(checkpoint)["extra"] == {"when": "old"}
    assert not checkpoint_problems(checkpoint)


class PlainEnum(str, enum.Enum):
    old = "old"


@pytest.mark.parametrize("content", [b'{"step": 1}\n', b"", b"1\t2\t3\n"], ids=["json", "empty", "tsv"])
def test_a_file_that_is_no_torch_file_is_not_called_unsafe(tmp_path, content):
    """A JSON or text file given as a checkpoint went to the pickle reader and
    was refused as able to run code (\"it holds , which is not plain data\")
    with advice to convert it; it is simply not a torch file, and says so."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError) as error:
        safe_load.torch_file(path)
    assert not isinstance(error.value, safe_load.UnsafeFile)
    assert str(error.value) == (f"cannot read checkpoint file {path}: not a file torch.save writes (neither a zip "
                                "archive nor a pickle)")
