"""The resolved config written as TOML text (the run folder's config.toml): loading it gives the same
config back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titanrush.config.schema import JobConfig, sections


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML text (written to the run folder)."""
    lines: list[str] = []
    for name in sections():
        lines.append(f"[{name}]")
        for key, value in dataclasses.asdict(getattr(cfg, name)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot write {value!r} as TOML")


def _toml_char(c: str) -> str:
    """One character of a TOML basic string: quotes, backslashes and control characters escaped."""
    if c in ('"', "\\"):
        return "\\" + c
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f"\\u{ord(c):04X}"
    return c
