"""key=value options of the commands that are not Hydra apps (predict, evaluate, export).

The options are a dataclass; an unknown key or a value of the wrong type is
a UserError naming the key, before any work.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from recsys_cli.errors import UserError

T = TypeVar("T")


def help_text(schema: type, command: str, doc: str) -> str:
    from omegaconf import OmegaConf

    return f"usage: recsys {command} key=value ...\n\n{doc.strip()}\n\noptions (defaults):\n" + OmegaConf.to_yaml(
        OmegaConf.structured(schema))


def parse_options(schema: type[T], overrides: list[str], command: str) -> T:
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    known = ", ".join(f.name for f in dataclasses.fields(schema))
    for o in overrides:
        if "=" not in o:
            raise UserError(f"`recsys {command}` takes key=value options, got {o!r} (options: {known})")
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        obj: Any = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        raise UserError(f"unknown option '{e.full_key or e.key}' for `recsys {command}` (options: {known})") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise UserError(f"bad value for '{key}': {msg}" if key else msg) from None
    return obj


def require(value: Any, key: str, command: str, example: str) -> Any:
    if value in (None, ""):
        raise UserError(f"`recsys {command}` needs {key}= ({example})")
    return value
