"""Every file of a checkpoint is checked against the checksum written beside it
(issue 27): bytes flipped in the .pt, a disk table's base or one of its deltas
are one line naming the file for every reader (resume, init_from, predict,
evaluate, export, `recsys verify`), and a resume names the older checkpoint
that is intact. One small disk-placement run is the fixture of them all."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from datasets import write_dataset
from commands import completed_in_process
from test_bad_input import LR, assert_user_error
from train_config import config

from recsys_cli.embeddings import disk_checkpoint
from recsys_cli.errors import UserError
from recsys_cli.checkpoints.record import read_record

STEPS = dict(trainer__batch_size=50, trainer__checkpoint_every=3, optimizer__lr=LR, trainer__device="cpu",
             placement__kind="disk", placement__host_cache_rows=8)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A disk run checkpointed at step 3 (a new base) and 6 (a delta on it)."""
    from recsys_cli.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("checksums")
    data = write_dataset(tmp, {"train": 600, "val": 200, "test": 200})
    save = disk_checkpoint.DiskTableSnapshot.save_files

    def base_then_deltas(self, directory, step):
        disk_checkpoint.COMPACT_FRACTION = 0.0 if step == 3 else 100.0
        return save(self, directory, step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(disk_checkpoint.DiskTableSnapshot, "save_files", base_then_deltas)
        mp.setattr(disk_checkpoint, "COMPACT_FRACTION", disk_checkpoint.COMPACT_FRACTION)
        cfg = config(tmp / "cache", dataset__path=str(data), trainer__max_steps=6,
                     trainer__checkpoint_dir=str(tmp / "run" / "checkpoints"),
                     placement__disk_path=str(tmp / "live"), **STEPS)
        Trainer(cfg, run_dir=tmp / "run").fit()
    return tmp, data


def damaged_copy(run, tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """A copy of the run with 64 bytes flipped in the middle of one file of
    its step-6 checkpoint: (the run directory, the damaged file)."""
    src, data = run
    copy = tmp_path / "run"
    shutil.copytree(src / "run", copy)
    ck = copy / "checkpoints"
    names = read_record(ck / "step-00000006.pt")
    name = {"pt": "step-00000006.pt"}.get(kind) or min(n for n in names if f"/{kind}-" in n)
    path = ck / name
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2
    raw[at:at + 64] = bytes(b ^ 0xFF for b in raw[at:at + 64])
    path.write_bytes(bytes(raw))
    return copy, path


KINDS = ["pt", "base", "delta"]


@pytest.mark.parametrize("kind", KINDS)
def test_resume_names_the_damaged_file_and_the_intact_older_checkpoint(run, tmp_path, kind):
    from recsys_cli.train.trainer import Trainer

    copy, path = damaged_copy(run, tmp_path, kind)
    ck = copy / "checkpoints"
    cfg = config(run[0] / "cache", dataset__path=str(run[1]), trainer__max_steps=8, trainer__resume="true",
                 trainer__checkpoint_dir=str(ck), placement__disk_path=str(tmp_path / "live"), **STEPS)
    with pytest.raises(UserError) as error:
        Trainer(cfg, run_dir=copy)
    message = str(error.value)
    assert message.startswith(f"checkpoint file {path} is damaged: its xxh3_64 is "), message
    if kind == "base":  # step 3's base is step 6's too: nothing older is whole
        assert message.endswith(f"no older checkpoint in {ck} is intact"), message
    else:
        older = ck / "step-00000003.pt"
        assert message.endswith(f"the older checkpoint {older} is intact: resume from it with "
                                f"trainer.resume={older}"), message
    assert "\n" not in message


@pytest.mark.parametrize("record", ['{"format": 2, "files": {"step-00000006.pt": {"bytes": "x"}}}',
                                    '{"format": 2, "files": {"step-00000006.pt": {"bytes": 10}}}', '{"files": [1'])
def test_a_damaged_record_is_named_not_a_traceback_or_read_unchecked(run, tmp_path, record):
    """A record whose entry had no integer size failed with a traceback
    (ValueError: Cannot specify ',' with 's'.); one that was not JSON let
    the checkpoint be read unchecked, with a warning that it had no record."""
    from recsys_cli.train.trainer import Trainer

    src, data = run
    copy = tmp_path / "run"
    shutil.copytree(src / "run", copy)
    ck = copy / "checkpoints"
    (ck / "step-00000006.files.json").write_text(record)
    cfg = config(src / "cache", dataset__path=str(data), trainer__max_steps=8, trainer__resume="true",
                 trainer__checkpoint_dir=str(ck), placement__disk_path=str(tmp_path / "live"), **STEPS)
    with pytest.raises(UserError) as error:
        Trainer(cfg, run_dir=copy)
    assert str(error.value) == (f"checkpoint file {ck / 'step-00000006.files.json'} is damaged: not a readable "
                                f"record of its checkpoint's files and checksums; the older checkpoint "
                                f"{ck / 'step-00000003.pt'} is intact: resume from it with "
                                f"trainer.resume={ck / 'step-00000003.pt'}")


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_names_the_damaged_file(run, tmp_path, kind):
    from recsys_cli.train.trainer import Trainer

    copy, path = damaged_copy(run, tmp_path, kind)
    cfg = config(run[0] / "cache", dataset__path=str(run[1]), trainer__max_steps=2,
                 trainer__init_from=str(copy / "checkpoints"), placement__disk_path=str(tmp_path / "live"), **STEPS)
    with pytest.raises(UserError, match=f"^checkpoint file {path} is damaged: its xxh3_64 is [0-9a-f]{{16}}, its "
                                        "checkpoint's record says [0-9a-f]{16}$"):
        Trainer(cfg, run_dir=tmp_path / "new")


@pytest.mark.parametrize("kind", KINDS)
def test_predict_evaluate_export_name_the_damaged_file(run, tmp_path, kind):
    from recsys_cli.evaluate import EvaluateConfig, evaluate
    from recsys_cli.export import ExportConfig, export
    from recsys_cli.predict import PredictConfig, predict

    copy, path = damaged_copy(run, tmp_path, kind)
    readers = {
        "predict": lambda: predict(PredictConfig(checkpoint=str(copy), input=str(run[1]), split="val", device="cpu",
                                                 output=str(tmp_path / "p.csv"), progress=False)),
        "evaluate": lambda: evaluate(EvaluateConfig(checkpoint=str(copy), split="val", device="cpu", plots=False,
                                                    output=str(tmp_path / "eval"), progress=False)),
        "export": lambda: export(ExportConfig(checkpoint=str(copy), output=str(tmp_path / "m.pt2"))),
    }
    for reader, call in readers.items():
        with pytest.raises(UserError, match=f"^checkpoint file {path} is damaged"):
            call()
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "m.pt2").exists()


def test_the_intact_run_loads_and_verify_checks_every_checkpoint(run, tmp_path, capsys):
    """The CLI: `recsys verify RUN` passes the intact run, and a damaged delta
    is one line, exit 2, from verify and from predict (main() in this process,
    commands.completed_in_process: the lines, not the process)."""
    src, data = run
    ok = completed_in_process(["verify", str(src / "run")], capsys)
    assert ok.returncode == 0 and ok.stdout.startswith(f"ok: {src / 'run' / 'checkpoints'}: 2 checkpoint(s)"), ok
    copy, path = damaged_copy(run, tmp_path, "delta")
    bad = completed_in_process(["verify", str(copy)], capsys)
    assert_user_error(bad, f"checkpoint file {path} is damaged: its xxh3_64 is", "1 problem(s) in 2 checkpoint(s)")
    r = completed_in_process(["predict", f"checkpoint={copy}", f"input={data}", "split=val",
                              f"output={tmp_path / 'p.csv'}", "device=cpu", "progress=false"], capsys)
    assert_user_error(r, f"checkpoint file {path} is damaged")




def as_crc32_records(run_dir: Path) -> None:
    """Rewrite every record of a run as a run checkpointed before XXH3-64 wrote them: crc32 per file."""
    import zlib

    from recsys_cli.checkpoints.record import write_record

    for pt in sorted((run_dir / "checkpoints").glob("step-*.pt")):
        write_record(pt, {n: {"bytes": (pt.parent / n).stat().st_size,
                              "crc32": f"{zlib.crc32((pt.parent / n).read_bytes()):08x}"} for n in read_record(pt)})


@pytest.mark.parametrize("kind", ["pt", "delta"])
def test_a_run_recorded_with_crc32_before_xxh3_is_still_checked(run, tmp_path, kind):
    """Older records name crc32: an intact run still verifies and loads, and a
    damaged file of it is still one line naming the file."""
    from recsys_cli.inference import load_model
    from recsys_cli.checkpoints.verify import checkpoint_problems

    src, data = run
    intact = tmp_path / "intact"
    shutil.copytree(src / "run", intact)
    as_crc32_records(intact)
    assert [checkpoint_problems(pt) for pt in sorted((intact / "checkpoints").glob("step-*.pt"))] == [[], []]
    load_model(str(intact), device="cpu")
    ck = intact / "checkpoints" / "step-00000006.pt"
    path = ck if kind == "pt" else ck.parent / min(n for n in read_record(ck) if "/delta-" in n)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    (problem,) = checkpoint_problems(ck)
    assert problem.startswith(f"checkpoint file {path} is damaged: its crc32 is "), problem
