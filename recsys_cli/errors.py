"""Errors the user can fix. The CLI prints them without a traceback."""


class UserError(Exception):
    """Bad input, config or environment; the message says what and where."""
