"""`--help` and the config reference: every key with its type, default and docstring.

The docstrings are read from the source of `titanrush.config.schema` (the string literal under each
field); `scripts/gen_config_doc.py` renders the same into docs/config.md.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import shutil
import textwrap
import typing
from typing import Any, Literal

from titanrush.config.schema import ConfigError, _field_types, sections


def field_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from the source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def help_text(width: int | None = None, topic: str | None = None) -> str:
    """Every key with its type, default and docstring, grouped by section and wrapped to `width` columns,
    then an overview of the sections; or, with `topic`, only what it names.

    Args:
        width: Columns to wrap to; None: the terminal's (`COLUMNS`, else 80 where there is no terminal).
        topic: A section (`training`, `[training]`), a key (`training.seq_len`), or a word that key names
            hold (`warmup`, `seq`): those keys only. None: every key.

    Raises:
        ConfigError: `topic` names no section and no key.
    """
    width = max(40, width or shutil.get_terminal_size().columns)
    chosen = _topic_keys(topic) if topic is not None else None
    intro = (
        "Config keys, by section: in a TOML file as [section] then key = value, on the command line as "
        "--section.key value (booleans: --section.key / --no-section.key; lists: a,b,c)."
    )
    lines = [_wrap(intro, width, "", ""), ""]
    for name, cls in sections().items():
        fields = [f for f in dataclasses.fields(cls) if chosen is None or f"{name}.{f.name}" in chosen]
        if fields:
            lines += [f"[{name}]", *_key_lines(name, cls, fields, width), ""]
    return "\n".join(lines + (_overview(width) if chosen is None else []))


def _wrap(text: str, width: int, first: str, rest: str) -> str:
    return textwrap.fill(
        text,
        width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _key_lines(name: str, cls: type, fields: list[dataclasses.Field], width: int) -> list[str]:
    """Each field's two entries: `--section.key (type, default ...)`, then its docstring, indented."""
    docs, types_ = field_docstrings(cls), _field_types(cls)
    lines = []
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        # the key is the line's indent, so that it is never broken from its type
        what = f"({type_name(types_[f.name])}, default {default!r})"
        lines.append(_wrap(what, width, f"  --{name}.{f.name} ", "        "))
        lines.append(_wrap(docs.get(f.name, ""), width, "      ", "      "))
    return lines


def _overview(width: int) -> list[str]:
    """The sections, a line each with its keys' names (cut to the width): the end of the full reference,
    what a terminal shows of it."""
    lines = [
        _wrap(
            "Sections (--help SECTION shows one, e.g. --help training; --help WORD the keys whose name "
            "holds WORD, e.g. --help warmup):",
            width,
            "",
            "",
        )
    ]
    for name, cls in sections().items():
        keys = ", ".join(f.name for f in dataclasses.fields(cls))
        line = f"  {name:<22} {keys}"
        lines.append(line if len(line) <= width else line[: width - 3].rstrip(" ,") + "...")
    return lines


def _topic_keys(topic: str) -> set[str]:
    """The `section.key` names that `--help TOPIC` shows: a section's keys, one key, or the keys whose
    name holds the word (case-insensitive); ConfigError naming the sections when nothing matches."""
    all_keys = {n: [f"{n}.{f.name}" for f in dataclasses.fields(cls)] for n, cls in sections().items()}
    word = topic.strip().strip("[]").lower()
    word = word[2:] if word.startswith("--") else word
    if word in all_keys:
        return set(all_keys[word])
    found = {key for keys in all_keys.values() for key in keys if word and word in key.lower()}
    if not found:
        raise ConfigError(
            f"--help {topic}: no section or key name holds {word!r}; sections: {', '.join(all_keys)} "
            "(--help alone lists every key)"
        )
    return found


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{typing.get_args(tp)[0].__name__}]"
    return getattr(tp, "__name__", str(tp))
