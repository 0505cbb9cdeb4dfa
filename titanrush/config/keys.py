"""A key's name and value checked: the section and key looked up (suggesting the nearest name when
unknown), the value converted to the field's type, or a `ConfigError` naming the key and the fix.

Shared by both ways a value arrives: a TOML file (`loader`) and the command line (`overrides`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from typing import Any, Literal

from titanrush.config.schema import ConfigError, JobConfig, _field_types, sections


def _shown(value: Any, limit: int = 60) -> str:
    """repr(value) for a message, cut to `limit` characters (a 5000-digit number stays one short line)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's limit on the digits of a printed int (a TOML hex literal)
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else f"{text[: limit - 10]}... ({len(text)} characters)"


def _max_digits() -> int:
    """The most digits Python reads into an int (`sys.set_int_max_str_digits`; 4300 by default)."""
    return getattr(sys, "get_int_max_str_digits", lambda: 4300)()


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    shown = _shown(value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            near = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{key} = {shown} is not one of {', '.join(map(str, choices))}{near}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {item_tp.__name__}, got {shown}")
        return [_coerce(key, item_tp, v, from_cli) for v in value]
    if origin in (typing.Union, types.UnionType):
        raise AssertionError(f"unsupported config type {tp}")
    if tp is bool:
        if from_cli and isinstance(value, str):
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {shown}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {shown}")
        too_long = ConfigError(f"{key} must be an integer of at most {_max_digits()} digits, got {shown}")
        if isinstance(value, int):
            try:
                str(value)  # (messages print it: a TOML hex literal can be past the limit of a printed int)
            except ValueError:
                raise too_long from None
            return value
        if from_cli and isinstance(value, str):
            _refuse_separators(key, value, "an integer")
            try:
                return int(value)
            except ValueError:
                if re.fullmatch(r"\s*[+-]?\d+\s*", value):  # digits past Python's int-reading limit
                    raise too_long from None
        raise ConfigError(f"{key} must be an integer, got {shown}")
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer past a float's range (~1.8e308)
                number = math.inf
        elif from_cli and isinstance(value, str):
            _refuse_separators(key, value, "a number")
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{key} must be a number, got {shown}")
        if not math.isfinite(number):  # (TOML and float() both accept inf and nan)
            raise ConfigError(f"{key} must be a finite number, got {shown}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {shown}")
        try:
            value.encode()  # (a command line's bytes that are not UTF-8 arrive as lone surrogates)
        except UnicodeEncodeError:
            raise ConfigError(
                f"{key} = {ascii(value)} holds bytes that are not UTF-8 text; write it in UTF-8"
            ) from None
        return value
    raise AssertionError(f"unsupported config type {tp}")


def _refuse_separators(key: str, value: str, kind: str) -> None:
    """Refuse a command-line number that Python reads but a person would not write there: `2_0` (Python's
    digit separator, which int() and float() take: on a command line it is a typo, not twenty), or digits
    of another script (int() reads '٢٠' as 20)."""
    if "_" in value:
        raise ConfigError(
            f"{key} must be {kind}, got {_shown(value)}: the command line takes no '_' between digits; "
            "write the digits alone"
        )
    if not value.isascii():
        raise ConfigError(f"{key} must be {kind} written in ASCII digits, got {_shown(value)}")


def _lookup(section: str, key: str | None) -> tuple[type, str]:
    """Check that section (and key) exist, suggesting the nearest valid name when not."""
    secs = sections()
    if section not in secs:
        near = difflib.get_close_matches(section, list(secs), n=1)
        hint = f"; did you mean [{near[0]}]?" if near else f"; sections are {', '.join(secs)}"
        raise ConfigError(f"unknown config section [{section}]{hint}")
    cls = secs[section]
    if key is None:
        return cls, ""
    names = [f.name for f in dataclasses.fields(cls)]
    if key not in names:
        elsewhere = [f"{s}.{key}" for s, c in secs.items() if key in {f.name for f in dataclasses.fields(c)}]
        near = difflib.get_close_matches(key, names, n=1)
        if elsewhere:  # the right key in the wrong section
            hint = f"; did you mean {elsewhere[0]}?"
        elif near:
            hint = f"; did you mean {section}.{near[0]}?"
        else:
            full = [f"{s}.{f.name}" for s, c in secs.items() for f in dataclasses.fields(c)]
            near = difflib.get_close_matches(f"{section}.{key}", full, n=1)
            hint = f"; did you mean {near[0]}?" if near else "; run with --help to list the keys"
        raise ConfigError(f"unknown config key {section}.{key}{hint}")
    return cls, key


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool) -> None:
    cls, _ = _lookup(section, key)
    tp = _field_types(cls)[key]
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", tp, value, from_cli))
