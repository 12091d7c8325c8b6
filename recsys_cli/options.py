"""key=value options of the commands that are not Hydra apps (predict, evaluate,
export, report, verify), the renamed keys' old spellings, and the `--help`
of every command (help_text).

The options are a dataclass, merged with the command line by OmegaConf as
Hydra merges train's and preprocess's (compose_errors words the errors for
all of them): an unknown key or a value of the wrong type is one line naming
the key, before any work.

One word, one meaning across commands (issue 42 item 4): a key that meant
something else in another command was renamed, and its old spelling still
works with one `deprecated:` line on stderr (Renamed, apply_renames).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

from recsys_cli.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a schema: a dataclass
V = TypeVar("V")


@dataclass(frozen=True)
class Renamed:
    """A key's old spelling: `old=value` is read as `new=value` with one
    `deprecated:` line saying why the word changed."""

    old: str
    new: str
    why: str  # what the old word means elsewhere (the clash the rename removes)


# predict, evaluate and export: precision= stores train's tables; these convert them.
CONVERT_RENAMED = Renamed("precision", "convert", "precision= is how `recsys train` stores the tables; here they are "
                                                  "converted for scoring")


def plain_word(value: Any) -> str | None:
    """An optional closed choice (config.Choice) as the plain string it
    spells: what goes into files read with weights_only."""
    return None if value is None else str(value)


def apply_renames(overrides: Sequence[str], renamed: Sequence[Renamed], command: str) -> list[str]:
    """`overrides` with every old spelling replaced by its new one (a
    dotted key below it too: `old.x=` -> `new.x=`), one deprecation line
    on stderr per old key used."""
    from recsys_cli.errors import error_line

    out = []
    said: set[str] = set()
    for o in overrides:
        key, eq, value = o.partition("=")
        bare = key.lstrip("+")
        for r in renamed:
            if eq and (bare == r.old or bare.startswith(r.old + ".")):
                new_key = r.new + bare[len(r.old):]
                if r.old not in said:
                    error_line(f"`recsys {command} {r.old}=` is now {r.new}= ({r.why}); the old spelling "
                               "still works and will be removed", "deprecated:", "yellow")
                    said.add(r.old)
                o = f"{key[:len(key) - len(bare)]}{new_key}={value}"
                break
        out.append(o)
    return out


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


def old_arguments(args: Sequence[str], command: str, positional: str, flags: dict[str, str] | None = None,
                  switches: dict[str, str] | None = None) -> list[str]:
    """The spellings before key=value (report's and verify's positional DIR,
    report's --out DIR and --no-plots) as key=value, one `deprecated:` line
    each: a word without `=` is `positional=word`, a flag of `flags` takes
    the next word (or `--flag=word`) as its key's value, a switch of
    `switches` is the key=value it stands for. Anything else is left for
    parse_options to refuse."""
    from recsys_cli.errors import error_line

    flags, switches = flags or {}, switches or {}
    out: list[str] = []

    def deprecated(old: str, new: str) -> None:
        error_line(f"`recsys {command} {old}` is now `recsys {command} {new}`; the old spelling still works and "
                   "will be removed", "deprecated:", "yellow")

    words = list(args)
    while words:
        word = words.pop(0)
        flag, eq, value = word.partition("=")
        if flag in flags:
            if not eq:
                if not words:
                    raise UserError(f"`recsys {command} {flag}` needs a value: {flags[flag]}=VALUE")
                value = words.pop(0)
            deprecated(f"{flag} {value}", f"{flags[flag]}={value}")
            out.append(f"{flags[flag]}={value}")
        elif word in switches:
            deprecated(word, switches[word])
            out.append(switches[word])
        elif not eq and not word.startswith("-") and not any(o.startswith(positional + "=") for o in out):
            deprecated(word, f"{positional}={word}")
            out.append(f"{positional}={word}")
        else:
            out.append(word)
    return out


def parse_options(schema: type[T], overrides: list[str], command: str, renamed: Sequence[Renamed] = ()) -> T:
    """The command's options: `schema`'s defaults merged with the key=value
    `overrides` (old spellings in `renamed` first read as their new keys)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from recsys_cli.compose_errors import one_line

    known = ", ".join(f.name for f in dataclasses.fields(schema))
    for o in overrides:
        if "=" not in o:
            raise UserError(f"`recsys {command}` takes key=value options, got {o!r} (options: {known})")
    overrides = apply_renames(overrides, renamed, command)
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        obj: Any = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise UserError(one_line(e, lambda key: f"unknown option '{key}' for `recsys {command}` (options: {known})"))\
            from None
    return obj


def require(value: V | None, key: str, command: str, example: str) -> V:
    if value in (None, ""):
        raise UserError(f"`recsys {command}` needs {key}= ({example})")
    return value
