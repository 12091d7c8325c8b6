"""`recsys train` with more than one process: each rank's run, and the launcher's entry points.

Apart from distributed.py (process groups, collectives, the launcher), which
the trainer's strategies use, so that distributed.py never imports the
trainer: the import graph runs app -> distributed_app -> trainer ->
strategies -> distributed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from recsys_cli.errors import UserError, error_line, say
from recsys_cli.train.preemption import EXIT_STATUS, Preempted, say_preempted
from recsys_cli.train.distributed import (PeerTimeout, TeardownHung, WorkerFailed, broadcast_object,
                                          exit_without_finalizing, init, launch, launched_by_agent, mark,
                                          peer_timeout, teardown, timed_out)


def train(cfg, run_dir: Path | None, hydra_record: Callable[[], None] | None = None) -> dict:
    """Train as one rank of the group the launcher (or torchrun) set up:
    join, agree on rank 0's run directory, train, leave. Rank 0 writes
    `hydra_record` (the run's .hydra/, app.save_hydra_config) once its Trainer is
    set up (a refused resume leaves the run's record as it was), and prints
    the summary; returns the summary."""
    from rich.console import Console

    from recsys_cli.train.progress import summary_table
    from recsys_cli.train.trainer import Trainer

    ctx = init(cfg.trainer.dist_timeout, cfg.trainer.device)
    mark("started")  # for the launcher's bound on teardown
    failed = True
    try:
        shared = broadcast_object(str(run_dir) if run_dir is not None else None)
        run_dir = Path(shared) if shared is not None else None
        console = Console() if ctx.is_main else None
        try:
            trainer = Trainer(cfg, run_dir=run_dir, console=console)
            if hydra_record is not None and ctx.is_main:
                hydra_record()
            summary = trainer.fit()
        except Preempted as e:  # every rank stopped at the same step; rank 0 wrote the checkpoint
            if ctx.is_main:
                say_preempted(str(e))
            sys.exit(EXIT_STATUS)
        except Exception as e:
            if timed_out(e):  # a peer stopped answering: one line naming it and the timeout
                raise peer_timeout(cfg.trainer.dist_timeout) from None
            raise
        if console is not None:
            console.print(summary_table(summary))
            say(console, f"run directory: {run_dir}  ({ctx.world_size} processes)", soft_wrap=True)
        mark("trained")  # every output is written: the launcher bounds what is left
        failed = False
        return summary
    finally:
        if not failed:  # after a failure a peer may never answer: just exit
            teardown()


def _train_or_user_error(cfg, run_dir: Path | None,
                         hydra_record: Callable[[], None] | None = None) -> tuple[dict | None, Exception | None]:
    try:
        return train(cfg, run_dir, hydra_record), None
    except (UserError, PeerTimeout) as e:
        return None, e


@record
def worker_main(cfg_container: dict, run_dir: str | None, job_logging: dict | None = None,
                hydra_record: Callable[[], None] | None = None) -> float | None:
    """The launcher's entrypoint: one worker of `recsys train trainer.nproc=N`.
    Rank 0 sets up the Hydra job's logging (its progress lines go to the
    run's app.log, as in one process); spawned workers do not inherit it."""
    import logging.config

    from omegaconf import OmegaConf

    from recsys_cli.config import TrainConfig, register_configs

    if job_logging and os.environ.get("RANK") == "0":
        logging.config.dictConfig(job_logging)
    register_configs()
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg_container)
    summary = train(cfg, Path(run_dir) if run_dir else None, hydra_record)
    mark("done")  # torn down: the launcher waits for this rank's return value, not for a hung rank
    exit_without_finalizing()  # the return value goes to the launcher, then the process ends ~2 s sooner
    val = summary["final"].get("val")
    return None if val is None else val["auc"]


def train_app(cfg, run_dir: Path, hydra_record: Callable[[], None] | None = None) -> float | None:
    """`recsys train` when more than one process trains: under torchrun this
    process is one rank; otherwise start trainer.nproc workers and wait.
    `hydra_record`: the run's .hydra/ files, which rank 0 writes once set up (train)."""
    from omegaconf import OmegaConf
    from rich.console import Console

    from recsys_cli.config import validate
    from recsys_cli.train.training_data import resolve_dataset

    err = Console(stderr=True)
    if launched_by_agent():
        rank = os.environ["RANK"]
        # A user error is caught inside `record`: it writes the error file
        # that torchrun's failure report prints, and it must hold no traceback
        # for an error the rank has already said in one line.
        outcome = record(_train_or_user_error)(cfg, run_dir, hydra_record)
        assert outcome is not None  # record gives the function's result, or raises
        summary, user_error = outcome
        if summary is None:  # train raised a user's error (or a peer's timeout): user_error
            error_line(f"rank {rank}: {user_error}")
            sys.exit(2 if isinstance(user_error, UserError) else 1)
        val = summary["final"].get("val")
        return None if val is None else val["auc"]
    try:
        validate(cfg)
        resolve_dataset(cfg.dataset)  # generate the built-in data once, not in every worker
    except UserError as e:
        error_line(str(e))
        sys.exit(2)
    container = OmegaConf.to_container(cfg, resolve=True)
    from hydra.core.hydra_config import HydraConfig

    job_logging = OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True) if HydraConfig.initialized() else None
    from torch.distributed.elastic.multiprocessing import SignalException

    started = time.time()
    try:
        results = launch(worker_main, cfg.trainer.nproc, container, str(run_dir), job_logging, hydra_record)
    except SignalException as e:  # Ctrl-C or a kill of this process: the workers are stopped
        if e.sigval == signal.SIGTERM:  # the agent passed it on: the workers stopped at a step with a checkpoint
            from recsys_cli.checkpoints.read import newest_checkpoint

            directory = Path(cfg.trainer.checkpoint_dir) if cfg.trainer.checkpoint_dir else run_dir / "checkpoints"
            newest = newest_checkpoint(directory) if directory.is_dir() else None
            if newest is not None and newest.stat().st_mtime >= started:
                sys.exit(EXIT_STATUS)  # rank 0 said where it stopped, in one line
            say_preempted("SIGTERM: the workers were stopped before they wrote a checkpoint"
                          + (f"; the newest is {newest}" if newest is not None else ""))
        error_line(f"interrupted ({e.sigval.name}); the workers were stopped")
        sys.exit(130)
    except TeardownHung as e:  # training ended and rank 0 wrote everything: said, not failed
        from recsys_cli.errors import warn

        warn(str(e))
        return None
    except WorkerFailed as e:
        error_line(str(e))
        if e.traceback and not e.one_line:
            err.print(e.traceback, highlight=False, markup=False)
        sys.exit(2 if e.user_error else 1)
    return results.get(0)
