"""Errors the user can fix, and how the command line reports them.

UserError and write_error are data_tools.errors' (one class: data_tools raises
it, the CLI catches it); `fail` prints one line and exits, for the CLI and the
Hydra apps it starts.
"""

import sys

from data_tools.errors import UserError, write_error

__all__ = ["UserError", "fail", "warn", "write_error"]


def fail(message: str, code: int = 2) -> None:
    """Print `error: message` on stderr as one line and exit with `code`."""
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: one line whatever the terminal width (scripts grep it)
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def warn(message: str) -> None:
    """Print `warning: message` on stderr as one line: the run goes on."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)
