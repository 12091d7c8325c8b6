"""Hydra/OmegaConf composition errors as one line that names the key.

Hydra reports a bad override over several lines (the schema's class names, a
hint about HYDRA_FULL_ERROR) and exits 1; the CLI wants one `error:` line and
exit 2 for every configuration error. Used by `recsys train` and
`recsys preprocess`.
"""

from __future__ import annotations

import re


def one_line(e: BaseException, unknown_key=None) -> str:
    """The reason of a composition error `e`; `unknown_key(key)` words the
    message for a key that is not in the schema."""
    from omegaconf.errors import OmegaConfBaseException

    # A bad key or value in a config file: Hydra says only "In 'group/file':
    # ConfigKeyError raised while composing config" and keeps the real error
    # as the exception's context.
    in_file = re.match(r"In '([^']+)': \w+ raised while composing config", str(e))
    if in_file and isinstance(e.__context__, OmegaConfBaseException):
        return f"{_reason(e.__context__, unknown_key)} (in {in_file.group(1)}.yaml)"
    return _reason(e, unknown_key)


def _reason(e: BaseException, unknown_key) -> str:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = e
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    text = str(e)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or "not in struct" in text:
        key = getattr(cause, "full_key", None) or getattr(cause, "key", None)
        if not key:
            m = re.search(r"[Kk]ey '([^']+)'", text) or re.search(r"override '([^']+)'", text)
            key = m.group(1) if m else "?"
        return unknown_key(key) if unknown_key else f"unknown key '{key}'"
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None)
        msg = str(cause).splitlines()[0]
        choice = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]$", msg)
        if key and choice:  # an Enum field of the schema (config.py): the words validate() uses
            return f"{key}={choice.group(1)!r} is not one of {choice.group(2)}"
        return f"bad value for '{key}': {msg}" if key else msg
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    first = re.sub(r"^In '[^']+': ", "", lines[0])
    if "Available options in" in text:  # a config group option that does not exist
        at = next(i for i, ln in enumerate(lines) if ln.startswith("Available options in"))
        options = [ln for ln in lines[at + 1:] if not ln.startswith(("Config search path", "provider="))]
        options = options[: next((i for i, ln in enumerate(options) if ln.startswith("Set the environment")), None)]
        return f"{first} (options: {', '.join(options)})"
    if type(e).__name__ == "OverrideParseException":
        return f"cannot parse the override: {first}"
    return first
