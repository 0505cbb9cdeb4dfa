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

from titanrush.config.schema import _field_types, sections


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


def help_text(width: int | None = None) -> str:
    """Every key with its type, default and docstring, grouped by section and wrapped to `width` columns.

    Args:
        width: Columns to wrap to; None: the terminal's (`COLUMNS`, else 80 where there is no terminal).
    """
    width = max(40, width or shutil.get_terminal_size().columns)

    def wrap(text: str, first: str, rest: str) -> str:
        return textwrap.fill(
            text,
            width,
            initial_indent=first,
            subsequent_indent=rest,
            break_long_words=False,
            break_on_hyphens=False,
        )

    intro = (
        "Config keys, by section: in a TOML file as [section] then key = value, on the command line as "
        "--section.key value (booleans: --section.key / --no-section.key; lists: a,b,c)."
    )
    lines = [wrap(intro, "", ""), ""]
    for name, cls in sections().items():
        lines.append(f"[{name}]")
        docs = field_docstrings(cls)
        types_ = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            # the key is the line's indent, so that it is never broken from its type
            what = f"({type_name(types_[f.name])}, default {default!r})"
            lines.append(wrap(what, f"  --{name}.{f.name} ", "        "))
            lines.append(wrap(docs.get(f.name, ""), "      ", "      "))
        lines.append("")
    return "\n".join(lines)


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{typing.get_args(tp)[0].__name__}]"
    return getattr(tp, "__name__", str(tp))
