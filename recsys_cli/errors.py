"""Errors the user can fix, and how the command line reports them.

UserError and write_error are data_tools.errors' (one class: data_tools raises
it, the CLI catches it); `fail` prints one line and exits, for the CLI and the
Hydra apps it starts. `say` (data_tools.errors') prints every line that
holds a user's value, a path or an exception's text through rich, escaped:
a bracket in it (gloo's `[/__w/pytorch/...cc:78]`) is never read as markup
(issue 40 problem 7).
"""

import sys
from typing import NoReturn

from data_tools.errors import UserError, say, write_error

__all__ = ["UserError", "error_line", "fail", "say", "warn", "write_error"]


def error_line(message: str, label: str = "error:", style: str = "bold red") -> None:
    """Print `error: message` on stderr as one line (soft_wrap: one line
    whatever the terminal width, scripts grep it)."""
    from rich.console import Console

    say(Console(stderr=True), message, label, style, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` on stderr as one line and exit with `code`."""
    error_line(message)
    sys.exit(code)


def warn(message: str) -> None:
    """Print `warning: message` on stderr as one line: the run goes on."""
    error_line(message, "warning:", "bold yellow")
