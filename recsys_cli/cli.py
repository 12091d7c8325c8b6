"""The `recsys` command: `recsys COMMAND key=value ...` for every command.

One grammar (issue 42 item 4): the word after `recsys` picks the command and
every other argument is a key=value override of the command's structured
config (a dataclass), merged by OmegaConf: train and preprocess through
Hydra's composition (config groups, sweeps), predict, evaluate, export,
report and verify through options.parse_options. A misspelt key or a bad
value is one line naming it, exit 2, for every command; a renamed key's old
spelling still works with one `deprecated:` line.
"""

from __future__ import annotations

import errno
import sys

from recsys_cli import determinism, wait_policy
from recsys_cli.errors import UserError, fail, write_error

USAGE = """usage: recsys COMMAND key=value ...
       recsys --version

commands:
  train                 train DLRM (recsys train placement=lookahead optimizer.lr=0.1)
  preprocess criteo     raw Criteo TSV -> parquet shards + manifest (input=PATH output=DIR)
  preprocess synthetic  synthetic Criteo-like data (rows=N output=DIR [format=tsv])
  report                table, CSV and plots of a run or sweep directory (input=DIR [output=DIR])
  predict               score raw TSV or a dataset with a checkpoint (checkpoint=RUN input=PATH output=preds.csv)
  evaluate              metrics and ROC/calibration plots of a checkpoint on a split (checkpoint=RUN [split=test])
  export                an inference artifact (checkpoint=RUN convert=fp32|fp16|int8|int4 format=pt2|module)
  verify                check a dataset's shards against its manifest, or a run's checkpoints (input=DIR)

`recsys COMMAND --help`: the command's purpose, its keys with their defaults and meaning, and examples;
sweeps: recsys train -m key=a,b
"""


def version_line() -> str:
    """`recsys --version`: the installed distribution's version (pyproject.toml's),
    and where the package running it lies, as `pip --version` says it."""
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        number = version("recsys")
    except PackageNotFoundError:  # run from a checkout that was never installed
        number = "(not installed)"
    where = Path(__file__).resolve().parent
    return f"recsys {number} from {where} (python {sys.version_info.major}.{sys.version_info.minor})"


def main(argv: list[str] | None = None) -> None:
    entry_point = argv is None  # the `recsys` script (tests pass argv when they call main() in their process)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command: a usage error, as for an unknown one (a script that forgot it must not pass)
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return
    command, rest = argv[0], argv[1:]
    wait_policy.set_default()  # before torch loads its OpenMP runtime, which reads it once
    try:
        determinism.enable_if_requested()
        if command == "train":
            from recsys_cli.train.app import run_train_app

            run_train_app(rest)
        elif command == "preprocess":
            from recsys_cli.preprocess import run_preprocess

            if rest and rest[0] in ("-h", "--help"):
                from recsys_cli.preprocess import preprocess_help

                print(preprocess_help())
                return
            if not rest or rest[0].startswith("-") or "=" in rest[0]:
                fail("preprocess needs a source: recsys preprocess criteo|synthetic ...")
            run_preprocess(rest[0], rest[1:])
        elif command == "report":
            from recsys_cli.report import run_report

            run_report(rest)
        elif command == "predict":
            from recsys_cli.predict import run_predict

            run_predict(rest)
        elif command == "evaluate":
            from recsys_cli.evaluate import run_evaluate

            run_evaluate(rest)
        elif command == "export":
            from recsys_cli.export import run_export

            run_export(rest)
        elif command == "verify":
            from recsys_cli.verify import run_verify

            run_verify(rest)
        else:
            print(USAGE)
            fail(f"unknown command {command!r}")
    except UserError as e:
        fail(str(e))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        fail(str(write_error(e.filename or "a file", e)))  # a write no closer handler names
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    else:
        if entry_point:  # done, exit status 0: end without the interpreter's finalization (~0.5-1 s of CPU)
            from recsys_cli.fast_exit import exit_without_finalizing

            exit_without_finalizing()


if __name__ == "__main__":
    main()
