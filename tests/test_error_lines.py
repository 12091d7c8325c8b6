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


def test_a_line_is_one_line_in_a_log_and_wrapped_on_a_terminal():
    """Off a terminal rich's width is 80: a run's lines (resumed from PATH at
    step N, a predict summary) broke mid-sentence in a log file."""
    long = "resumed from " + "/a/long/run/directory" * 6 + "/checkpoints/step-00001500.pt at step 1500"
    for terminal in (False, True):
        out = io.StringIO()
        say(Console(file=out, width=40, force_terminal=terminal, color_system=None), long)
        assert (out.getvalue() == long + "\n") is not terminal, out.getvalue()


@pytest.mark.parametrize("text", NASTY)
def test_error_and_warning_lines_hold_brackets(text, capsys):
    with pytest.raises(SystemExit) as exited:
        fail(text)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: {text}\n"
    warn(text)
    assert capsys.readouterr().err == f"warning: {text}\n"


def launcher_exit(monkeypatch, tmp_path, failure: WorkerFailed) -> int:
    """`recsys train trainer.nproc=N`'s launcher when a worker fails with `failure`: its exit status."""
    def failed(*args, **kwargs):
        raise failure

    monkeypatch.setattr(distributed_app, "launch", failed)
    monkeypatch.setattr("recsys_cli.config.validate", lambda cfg: None)
    monkeypatch.setattr("recsys_cli.train.training_data.resolve_dataset", lambda dataset: None)
    with pytest.raises(SystemExit) as exited:
        distributed_app.train_app(OmegaConf.structured(TrainConfig), tmp_path)
    return exited.value.code


def test_a_failed_rank_with_gloos_message_is_printed_by_the_launcher(monkeypatch, capsys, tmp_path):
    """`recsys train trainer.nproc=N` printed a failed rank's error with markup on."""
    failure = WorkerFailed(1, 4321, 1, f"RuntimeError: {GLOO}", user_error=True)
    assert launcher_exit(monkeypatch, tmp_path, failure) == 2
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


def test_a_collectives_timeout_is_told_from_other_errors():
    import torch.distributed as dist

    from recsys_cli.train.distributed import timed_out

    assert timed_out(RuntimeError(GLOO))
    assert timed_out(dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)"))
    try:
        try:
            raise RuntimeError(GLOO)
        except RuntimeError:
            raise ValueError("the prefetcher stopped")  # noqa: B904 - as a thread's error is passed on
    except ValueError as e:
        assert timed_out(e)
    assert not timed_out(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not timed_out(ValueError("a timeout of 3 s is too short"))


def test_a_peer_timeout_names_the_ranks_that_did_not_answer(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    from recsys_cli.train import distributed

    monkeypatch.setattr(distributed, "_context", distributed.DistContext(rank=1, world_size=2))
    assert str(distributed.peer_timeout(30)) == (
        "rank 1 waited 30 s (trainer.dist_timeout) in a collective for rank 0, which did not answer (stopped, hung "
        "or far slower): the run was stopped")

    class Store:  # ranks 0 and 2 timed out too: rank 3 is the one that hung
        keys = {"recsys/timed_out/0", "recsys/timed_out/2"}

        def set(self, key, value):
            self.keys.add(key)

        def check(self, keys):
            return all(k in self.keys for k in keys)

    monkeypatch.setattr(c10d, "_get_default_store", lambda: Store())
    monkeypatch.setattr(distributed, "ROLL_CALL_S", 0.2)
    monkeypatch.setattr(distributed, "_context", distributed.DistContext(rank=1, world_size=4))
    assert "in a collective for rank 3, which did not answer" in str(distributed.peer_timeout(30))


def test_a_hung_peer_is_one_line_without_the_traceback_exit_1(monkeypatch, capsys, tmp_path):
    message = "rank 0 waited 10 s (trainer.dist_timeout) in a collective for rank 1, which did not answer"
    failure = WorkerFailed(0, 4321, 1, message, traceback=f"Traceback (most recent call last):\n  {GLOO}",
                           one_line=True)
    assert launcher_exit(monkeypatch, tmp_path, failure) == 1
    assert capsys.readouterr().err == f"error: rank 0 (pid 4321) failed: {message}; the other ranks were stopped\n"
