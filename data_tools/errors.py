"""Errors the user can fix. The command line prints them as one line, without a traceback, and exits 2.

Defined here, in the lower package, so that data_tools raises them without
importing recsys_cli; recsys_cli.errors re-exports them.
"""

import errno
import os
from typing import Any


class UserError(Exception):
    """Bad input, config or environment; the message says what and where."""


def write_error(path: "str | os.PathLike", e: OSError, then: str = "") -> UserError:
    """A failed write as one line naming the file (a full disk is the usual cause)."""
    reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return UserError(f"cannot write {path}: {reason}" + (f"; {then}" if then else ""))


def say(console: Any, text: object, label: str = "", style: str = "bold", **kwargs: Any) -> None:
    """Print `label` in `style`, a space, then `text` exactly as given on the
    rich `console` (kwargs go to console.print). The line is a rich Text, not
    markup: a bracket in a path, a user's value or an exception's message
    (gloo's `[/__w/pytorch/...cc:78]`) is printed as it is, and printing it
    never fails (issue 40 problem 7). Every line with such text goes through
    here (recsys_cli.errors re-exports it). Off a terminal (a log file, a
    pipe: rich's width is then 80) the line is not wrapped, so a logged line
    stays one line to grep."""
    from rich.text import Text

    line = Text.assemble((label, style), " ") if label else Text()
    line.append(str(text))
    kwargs.setdefault("soft_wrap", not getattr(console, "is_terminal", False))
    console.print(line, **kwargs)
