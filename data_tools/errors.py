"""Errors the user can fix. The command line prints them as one line, without a traceback, and exits 2.

Defined here, in the lower package, so that data_tools raises them without
importing recsys_cli; recsys_cli.errors re-exports them.
"""

import errno
import os


class UserError(Exception):
    """Bad input, config or environment; the message says what and where."""


def write_error(path: "str | os.PathLike", e: OSError, then: str = "") -> UserError:
    """A failed write as one line naming the file (a full disk is the usual cause)."""
    reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return UserError(f"cannot write {path}: {reason}" + (f"; {then}" if then else ""))
