"""key=value options of the commands that are not Hydra apps (predict, evaluate, export),
and the `--help` of every command (help_text).

The options are a dataclass; an unknown key or a value of the wrong type is
a UserError naming the key, before any work.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

from recsys_cli.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a schema: a dataclass
V = TypeVar("V")


def field_help(schema: type) -> dict[str, str]:
    """{dotted key: description} of a structured config's fields, nested
    dataclasses included: a field's metadata["help"], else its comments in
    the source, the block of comment lines right above the field and the
    comment at the end of its line (the schema's comments are the keys'
    one description, for the reader of the code and for `--help` alike)."""
    import typing

    out: dict[str, str] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints.get(f.name)
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            out.update({f"{f.name}.{k}": v for k, v in field_help(kind).items()})
            continue
        owner = next(c for c in schema.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
        out[f.name] = f.metadata.get("help") or _comments(owner).get(f.name, "")
    return out


_comment_cache: dict[type, dict[str, str]] = {}


def _comments(cls: type) -> dict[str, str]:
    """{field: its comments} from the source of dataclass `cls`."""
    if cls in _comment_cache:
        return _comment_cache[cls]
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen build): no descriptions, the keys and defaults remain
        return {}
    lines = source.splitlines()
    trailing = {t.start[0]: t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT and lines[t.start[0] - 1].strip() != t.string.strip()}
    found: dict[str, str] = {}
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        above: list[str] = []
        i = statement.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        end = trailing.get(statement.end_lineno or statement.lineno, "").lstrip("#").strip()
        found[statement.target.id] = " ".join(part for part in (*above, end) if part)
    _comment_cache[cls] = found
    return found


def _word(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_word(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_word(v)}" for k, v in value.items()) + "}"
    return str(value)


def schema_entries(schema: type, values: Any = None) -> list[tuple[str, str]]:
    """[("key=default", description)] of every key of `schema`, with the
    defaults of `values` (a composed config; default: the schema's own)."""
    from omegaconf import OmegaConf

    described = field_help(schema)
    node = OmegaConf.to_container(OmegaConf.structured(schema) if values is None else values, resolve=True)
    assert isinstance(node, dict)
    entries = []

    def walk(d: dict, prefix: str) -> None:
        for key, value in d.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and any(k.startswith(name + ".") for k in described):
                walk(value, name + ".")
            else:
                entries.append((f"{name}={_word(value)}", described.get(name, "")))

    walk(node, "")
    return entries


def help_text(command: str, doc: str, examples: Sequence[str], *, schema: type | None = None, values: Any = None,
              entries: Sequence[tuple[str, str]] | None = None, usage: str | None = None, extra: str = "") -> str:
    """`recsys COMMAND --help`, one layout for every command: usage, the
    command's purpose, its keys with their defaults and descriptions (from
    `schema`'s fields, or `entries` for the commands with positional
    arguments), `extra` (train's groups), and two examples."""
    import textwrap

    rows = list(entries) if entries is not None else schema_entries(schema, values) if schema is not None else []
    purpose = [part for line in doc.strip().splitlines() for part in (textwrap.wrap(line, 100) or [""])]
    out = [f"usage: {usage or f'recsys {command} key=value ...'}", "", *purpose, ""]
    if extra:
        out += [extra.rstrip(), ""]
    if rows:
        out.append("keys (key=default, then what it means):" if entries is None else "arguments:")
        width = max(len(name) for name, _ in rows) + 2
        for name, description in rows:
            if width <= 34:  # a column of keys, their descriptions beside them
                lines = textwrap.wrap(description, 100 - width - 2) or [""]
                out.append(f"  {name.ljust(width)}{lines[0]}".rstrip())
                out += [" " * (width + 2) + line for line in lines[1:]]
            else:  # long dotted keys (train): each description under its key
                out.append(f"  {name}")
                out += textwrap.wrap(description, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
        out.append("")
    out.append("examples:")
    out += [f"  {e}" for e in examples]
    return "\n".join(out)


def wants_help(args: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") for a in args)


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


def require(value: V | None, key: str, command: str, example: str) -> V:
    if value in (None, ""):
        raise UserError(f"`recsys {command}` needs {key}= ({example})")
    return value
