"""Lines printed through rich hold brackets as they are (issue 40 problem 7).

gloo's errors carry `[/__w/pytorch/pytorch/third_party/gloo/...cc:78]`, which
rich read as a closing markup tag: the error printer itself crashed
(rich.errors.MarkupError) and the real error was never shown. Paths and a
user's values may hold brackets too.
"""

from __future__ import annotations

import io

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from recsys_cli.config import TrainConfig
from recsys_cli.errors import fail, say, warn
from recsys_cli.train import distributed_app
from recsys_cli.train.distributed import WorkerFailed

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
        "30000ms for recv operation to complete")
NASTY = [GLOO, "[/]", "[bold]not bold[/bold]", "a path /data/[2024]/run", "ends in a backslash \\", "[link=x]y[/link]"]


def printed(text: str, **kwargs) -> str:
    out = io.StringIO()
    say(Console(file=out, width=400), text, **kwargs)
    return out.getvalue()


@pytest.mark.parametrize("text", NASTY)
def test_say_prints_the_text_as_it_is(text):
    assert printed(text) == text + "\n"
    assert printed(text, label="error:", style="bold red") == f"error: {text}\n"


@pytest.mark.parametrize("text", NASTY)
def test_error_and_warning_lines_hold_brackets(text, capsys):
    with pytest.raises(SystemExit) as exited:
        fail(text)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: {text}\n"
    warn(text)
    assert capsys.readouterr().err == f"warning: {text}\n"


def test_a_failed_rank_with_gloos_message_is_printed_by_the_launcher(monkeypatch, capsys, tmp_path):
    """`recsys train trainer.nproc=N` printed a failed rank's error with markup on."""
    def failed(*args, **kwargs):
        raise WorkerFailed(1, 4321, 1, f"RuntimeError: {GLOO}", user_error=True)

    monkeypatch.setattr(distributed_app, "launch", failed)
    monkeypatch.setattr("recsys_cli.config.validate", lambda cfg: None)
    monkeypatch.setattr("recsys_cli.train.training_data.resolve_dataset", lambda dataset: None)
    with pytest.raises(SystemExit) as exited:
        distributed_app.train_app(OmegaConf.structured(TrainConfig), tmp_path)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: rank 1 (pid 4321) failed: RuntimeError: {GLOO}; the other ranks were stopped\n"



def test_report_tables_print_run_labels_and_paths_with_brackets():
    from recsys_cli.report.tables import _packed_tables

    tables = _packed_tables("recsys report: /runs/[2024]", ["run", "AUC"], [["[/x] lr=[1e-3]", "0.7"]], 200, "")
    out = io.StringIO()
    for table in tables:
        Console(file=out, width=200).print(table)
    assert "/runs/[2024]" in out.getvalue() and "[/x] lr=[1e-3]" in out.getvalue()


def test_a_rank_hung_in_teardown_is_a_warning_naming_it(monkeypatch, capsys, tmp_path):
    from recsys_cli.train.distributed import TeardownHung

    def hung(*args, **kwargs):
        raise TeardownHung([(1, 4321)], 60)

    monkeypatch.setattr(distributed_app, "launch", hung)
    monkeypatch.setattr("recsys_cli.config.validate", lambda cfg: None)
    monkeypatch.setattr("recsys_cli.train.training_data.resolve_dataset", lambda dataset: None)
    assert distributed_app.train_app(OmegaConf.structured(TrainConfig), tmp_path) is None  # exit 0: all was written
    assert capsys.readouterr().err == ("warning: rank 1 (pid 4321) had not exited 60 s after training ended (stopped "
                                       "or stuck while shutting down) and was killed; the run's results were written "
                                       "before\n")
