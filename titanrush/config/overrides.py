"""The command line: `--config FILE` and `--check` pulled out (`split_args`), and the overrides
(`--section.key value` and its other spellings) parsed into (section, key, value) with the section and
key checked; the values are converted by `load`.
"""

from __future__ import annotations

from typing import Any

from titanrush.config.keys import _lookup
from titanrush.config.schema import ConfigError, _field_types


def parse_overrides(args: list[str]) -> list[tuple[str, str, Any]]:
    """`--section.key value`, `--section.key=value`, `--section.key` (true), `--no-section.key`."""
    out: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not _looks_like_key(arg):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        section, key, negate, eq, value = _split(arg)
        cls, key = _lookup(section, key)
        is_bool = _field_types(cls)[key] is bool
        if negate:
            if not is_bool or eq:
                raise ConfigError(f"--no-{section}.{key} only applies to true/false keys without a value")
            out.append((section, key, False))
        elif eq:
            out.append((section, key, value))
        elif is_bool and (i + 1 >= len(args) or args[i + 1].startswith("--")):
            out.append((section, key, True))
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{section}.{key} needs a value")
            if _is_key(args[i + 1]):
                raise ConfigError(
                    f"--{section}.{key} needs a value (the next argument, {args[i + 1].partition('=')[0]}, "
                    "is another key)"
                )
            out.append((section, key, args[i + 1]))
            i += 1
        i += 1
    return out


def _looks_like_key(arg: str) -> bool:
    return arg.startswith("--") and "." in arg


def _split(arg: str) -> tuple[str, str, bool, str, str]:
    """`--[no-]section.key[=value]` as (section, key, negated, "=" or "", value)."""
    name, eq, value = arg[2:].partition("=")
    negate = name.startswith("no-")
    section, _, key = name.removeprefix("no-").partition(".")
    return section, key, negate, eq, value


def _is_key(arg: str) -> bool:
    """Whether `arg` is an override's `--section.key` (or `--no-section.key`) of a key that exists."""
    if not _looks_like_key(arg):
        return False
    section, key, *_ = _split(arg)
    try:
        _lookup(section, key)
    except ConfigError:
        return False
    return True


def repeated_overrides(args: list[str]) -> list[str]:
    """A line for each key that the overrides set more than once to different values, naming the values in
    order and the one that counts (the last: a wrapper script's defaults, then the caller's own, is the
    usual reason to give a key twice, and a common mistake, so it is said, not refused)."""
    given: dict[str, list[str]] = {}
    for section, key, value in parse_overrides(args):
        text = str(value).lower() if isinstance(value, bool) else value if value else "''"
        given.setdefault(f"{section}.{key}", []).append(text)
    lines = []
    for name, values in given.items():
        if len(set(values)) > 1:
            times = "twice" if len(values) == 2 else f"{len(values)} times"
            lines.append(
                f"--{name} is given {times} on the command line ({', then '.join(values)}): the last, "
                f"{values[-1]}, is used"
            )
    return lines


# `titanrush train --check --assume-cuda`: check a GPU config on a machine without the GPUs.
ASSUME_CUDA = "--assume-cuda"


def split_args(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """Pull --config FILE and --check out of argv; the rest are overrides."""
    paths, check, rest = [], False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg == "--job.config_file":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file path")
            paths.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(("--config=", "--job.config_file=")):
            paths.append(arg.split("=", 1)[1])
        elif arg == "--check":
            check = True
        else:
            rest.append(arg)
        i += 1
    if len(set(paths)) > 1:
        raise ConfigError(
            f"--config is given {len(paths)} times ({', then '.join(paths)}): one run reads one config file; "
            "keep one, and change its values with --section.key value"
        )
    return (paths[0] if paths else None), check, rest
