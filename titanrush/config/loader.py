"""Loading a config: defaults < TOML file (with its `extends` chain) < command-line overrides.

`load` builds the `JobConfig`; `read_toml` reads a TOML file and the files it extends. An error in a file
names the file and line of the key (`toml_line`: tomllib gives no positions).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titanrush.config.keys import _lookup, _max_digits, _set, _shown
from titanrush.config.overrides import ASSUME_CUDA, parse_overrides, split_args
from titanrush.config.schema import ConfigError, JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - only where tomllib is missing
    import tomli as tomllib


def read_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML config, following `extends = "other.toml"` (relative to the file) first."""
    return _read_toml(Path(path), ())[0]


# (section, key) -> the file of an `extends` chain that sets it; (section, None): a file that has the table
Origins = dict[tuple[str, str | None], Path]


def _read_toml(
    path: Path, seen: tuple[Path, ...], extended_at: str = ""
) -> tuple[dict[str, dict[str, Any]], Origins]:
    """`read_toml`, and where each key comes from (the last file of the chain that sets it).
    `extended_at`: the `file:line` whose `extends` names `path` ('' for --config)."""
    named = (
        f"{extended_at}: extends names {str(path)!r}, which" if extended_at else f"config file {str(path)!r}"
    )
    fix = (
        "name a TOML file (relative to that file's folder)" if extended_at else "pass a TOML file to --config"
    )
    try:
        if path.is_dir():
            raise ConfigError(f"{named} is a folder; {fix}")
        if not path.exists():
            raise ConfigError(f"{named} is not found; {fix}")
        if not path.is_file():
            raise ConfigError(f"{named} is not a regular file (a pipe or a device); {fix}")
        resolved = path.resolve()
        raw = path.read_bytes()
    except OSError as e:  # permissions, an I/O error, a name too long ...
        raise ConfigError(f"{named} cannot be read ({e.strerror or e}); {fix}") from None
    if resolved in seen:
        raise ConfigError(f"config file {str(path)!r} extends itself (through {seen[-1].name})")
    try:
        text = raw.decode("utf-8-sig")  # (a byte-order mark, as some Windows editors write, is dropped)
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    except ValueError:  # tomllib's int() past Python's limit on the digits of an integer
        raise ConfigError(
            f"{_longest_number(path, text)}: an integer of more than {_max_digits()} digits, which Python "
            "does not read; write a smaller value"
        ) from None
    if all(isinstance(v, dict) and not v for v in data.values()):  # (comments or empty tables only, too)
        undo = "remove the extends line" if extended_at else "leave --config out to train with the defaults"
        raise ConfigError(
            f"{named} is empty: it sets no key, so the run would take the defaults; put the settings in "
            f"it, or {undo}"
        )
    base: dict[str, dict[str, Any]] = {}
    origins: Origins = {}
    parent = data.pop("extends", None)
    if parent is not None:
        where = _where(path, "extends", None)
        if not isinstance(parent, str) or not parent.strip():
            raise ConfigError(
                f"{where}: extends must name the TOML file this one builds on, got {_shown(parent)}; name "
                "one or remove the key"
            )
        base, origins = _read_toml(path.parent / parent, seen + (resolved,), where)
    for section, values in data.items():
        if not isinstance(values, dict):
            where = _where(path, section, None)
            raise ConfigError(f"{where}: top-level key {section!r} must be a [section] table")
        base.setdefault(section, {}).update(values)
        origins[(section, None)] = path
        origins.update({(section, key): path for key in values})
    return base, origins


def _longest_number(path: Path, text: str) -> str:
    """`path:line` of the line with the longest run of digits (the integer tomllib could not read)."""
    runs = [
        (max(map(len, re.findall(r"[0-9A-Fa-f_]+", line)), default=0), n)
        for n, line in enumerate(text.splitlines(), 1)
    ]
    return f"{path}:{max(runs)[1]}" if runs else str(path)


def _where(path: Path, section: str, key: str | None) -> str:
    """`path:line` of `key` in table [section] (key None: the table, or a top-level key `section`), or
    `path` where its text does not show it plainly."""
    try:
        line = toml_line(path.read_text(), section, key)
    except OSError:
        line = None
    return f"{path}:{line}" if line else str(path)


def toml_line(text: str, section: str, key: str | None = None) -> int | None:
    """The 1-based line that sets `key` of table [section] in a TOML text (tomllib gives no positions).

    Found: `key = ...` under a `[section]` header; before any header, a dotted `section.key = ...` or an
    inline table `section = {... key = ...}`. With key None: the `[section]` (or `[[section]]`) header,
    or a top-level `section = ...` / `section.x = ...`.
    """
    bare = _toml_key_pattern
    header = re.compile(rf"\s*\[\[?{bare(section)}\]")
    in_table = re.compile(rf"{bare(key)}=") if key else None
    if key is None:
        top = re.compile(rf"{bare(section)}[=.]")
    else:  # section.key = ..., or section = { ..., key = ... } on one line
        top = re.compile(rf"{bare(section)}(\.{bare(key)}=|=\s*\{{(.*,)?{bare(key)}=)")
    table: bool | None = None  # None: before the first header; then whether it is [section]
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("["):
            table = bool(header.match(line))
            if table and key is None:
                return number
            continue
        inside = bool(table) and in_table is not None and in_table.match(line) is not None
        if inside or (table is None and top.match(line)):
            return number
    return None


def _toml_key_pattern(name: str) -> str:
    """A regular expression for the TOML key `name`, bare or quoted, with the spaces around it."""
    return rf"""\s*["']?{re.escape(name)}["']?\s*"""


def load(config_path: str | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Build the job config: dataclass defaults, then the TOML file, then command-line overrides.

    Keys and types are checked here; values and their combinations by `titanrush.run.validate` (which
    `titanrush.run.plan.build_plan` runs).
    """
    cfg = JobConfig()
    if config_path is not None and not str(config_path).strip():
        raise ConfigError("--config is empty: pass a TOML file, or leave --config out for the defaults")
    if config_path:
        data, origins = _read_toml(Path(config_path), ())
        for section, values in data.items():
            with _located(origins[(section, None)], section, None):
                _lookup(section, None)
            for key, value in values.items():
                with _located(origins[(section, key)], section, key):
                    _set(cfg, section, key, value, from_cli=False)
    named = config_path and "name" in data.get("job", {})
    for section, key, value in parse_overrides(overrides or []):
        _set(cfg, section, key, value, from_cli=True)
        named = named or (section, key) == ("job", "name")
    if not named:  # (the default: each model its own run folder; an empty name given is refused later)
        cfg.job.name = cfg.model.flavor
    for section, key in HOME_PATHS:  # `~/runs`: the home folder (a shell expands it, not in TOML or quotes)
        setattr(getattr(cfg, section), key, os.path.expanduser(getattr(getattr(cfg, section), key)))
    return cfg


# Keys naming a file or folder where a leading `~` means the home folder (data.path, data.tokenizer and
# data.cache_dir are expanded where they are read: each item of a list, a tokenizer name that is no path).
HOME_PATHS = (
    ("job", "dump_folder"),
    ("checkpoint", "folder"),
    ("checkpoint", "load_path"),
    ("model", "from_checkpoint"),
)


@contextlib.contextmanager
def _located(path: Path, section: str, key: str | None) -> Iterator[None]:
    """A ConfigError raised inside names the file and line of [section] `key` first."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"{_where(path, section, key)}: {e}") from None


def load_command(argv: list[str]) -> tuple[JobConfig, bool, list[str]]:
    """(the config, whether --check is given, the overrides) of a training command line (`titanrush
    train`'s arguments), without torch; a ConfigError for a key, type or file that is wrong."""
    path, check, overrides = split_args([a for a in argv if a != ASSUME_CUDA])
    if ASSUME_CUDA in argv and not check:
        raise ConfigError(f"{ASSUME_CUDA} only checks (a run needs the GPUs): use it with --check")
    return load(path, overrides), check, overrides
