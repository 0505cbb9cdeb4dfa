"""Document sources: where text comes from, one iterator of documents per dataset kind.

A document is a `(key, text)` pair. The key is stable (a path relative to the dataset root, plus a
byte offset or row number inside .jsonl / .parquet files); a hash of it puts about 1% of the documents
in the validation split, so the split never changes when files are added, removed or reordered.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from titanrush.config import ConfigError

SUFFIXES = (".txt", ".jsonl", ".parquet")
"""File kinds the `files` dataset and `titanrush prepare` read."""
VALIDATION_PER_MILLE = 10
"""Documents whose key hashes below this (out of 1000) form the validation split (about 1%)."""
SPLITS = ("train", "validation")


class Document(NamedTuple):
    key: str
    """Stable identity: relative path, plus `:offset` for documents inside .jsonl / .parquet files."""
    text: str
    """The document's text."""


def split_of(key: str) -> str:
    """The split ("train" or "validation") a document key belongs to, by a stable hash."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return "validation" if int.from_bytes(digest, "little") % 1000 < VALIDATION_PER_MILLE else "train"


def check_split(split: str) -> None:
    """Raise ValueError for a split name other than train / validation."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


# ----------------------------------------------------------------------------------------------
# embedded: the standard library sources of the running interpreter


def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib root and its `*.py` files (sorted, site-packages and dist-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def embedded_documents(split: str, files: list[Path] | None = None) -> Iterator[Document]:
    """Documents of the `embedded` dataset: one per stdlib source file of `split`.

    The few stdlib files that are deliberately not UTF-8 (encoding tests) are skipped.
    """
    check_split(split)
    root, all_files = stdlib_files()
    for path in all_files if files is None else files:
        key = path.relative_to(root).as_posix()
        if split_of(key) != split:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            yield Document(key, text)


def embedded_files(split: str) -> list[Path]:
    """The stdlib files whose key falls in `split` (the embedded corpus's file list)."""
    check_split(split)
    root, files = stdlib_files()
    return [p for p in files if split_of(p.relative_to(root).as_posix()) == split]


# ----------------------------------------------------------------------------------------------
# files: .txt, .jsonl, .parquet under a path or glob


def find_files(pattern: str, key: str = "data.path") -> tuple[Path, list[Path]]:
    """Resolve a file, folder or glob to (root, sorted data files); ConfigError if there are none.

    Args:
        pattern: a file, a folder (searched recursively) or a glob (`**` allowed).
        key: the config key or flag named in error messages.

    Returns:
        The root that document keys are relative to, and the files with a supported suffix.
    """
    if not pattern:
        raise ConfigError(f"{key} is empty; set it to a file, folder or glob of {', '.join(SUFFIXES)} files")
    path = Path(pattern).expanduser()
    if glob.has_magic(str(path)):
        static = list(itertools.takewhile(lambda part: not glob.has_magic(part), path.parts))
        root = Path(*static) if static else Path(".")  # the folder above the first wildcard
        candidates = [Path(p) for p in glob.glob(str(path), recursive=True)]
        files = [p for p in candidates if p.is_file() and p.suffix in SUFFIXES]
    elif path.is_dir():
        root = path
        files = [p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    elif path.is_file():
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"{key} = {pattern!r}: unsupported file type; use {', '.join(SUFFIXES)} files")
        root, files = path.parent, [path]
    else:
        raise ConfigError(f"{key} = {pattern!r}: no such file or folder; check the path")
    if not files:
        raise ConfigError(
            f"{key} = {pattern!r} matches no {', '.join(SUFFIXES)} files; check the path or glob"
        )
    return root, sorted(files, key=lambda p: p.as_posix())


def _decode(path: Path, raw: bytes, where: str = "") -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}{where}: not UTF-8 text ({e.reason} at byte {e.start}); "
            "convert it to UTF-8 or remove it from data.path"
        ) from None
    if "\x00" in text:
        raise ConfigError(f"{path}{where}: not text (it holds NUL bytes); remove it from data.path")
    return text


def read_documents(
    path: Path, root: Path, text_field: str, start: int = 0, end: int | None = None
) -> Iterator[Document]:
    """The documents of one data file, or of the byte range [start, end) of a .jsonl file.

    Raises:
        ConfigError: naming the file (and line) when it is not UTF-8 text, not valid JSON lines,
            lacks `text_field`, or is a .parquet file without pyarrow installed.
    """
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
    if path.suffix == ".txt":
        text = _decode(path, _read(path))
        if text:
            yield Document(rel, text)
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path, rel, text_field, start, end)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path, rel, text_field)
    else:
        raise ConfigError(f"{path}: unsupported file type; use {', '.join(SUFFIXES)} files")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}); check the file") from None


def _read_jsonl(path: Path, rel: str, text_field: str, start: int, end: int | None) -> Iterator[Document]:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            offset = start
            for raw in f:
                if end is not None and offset >= end:
                    break
                line_offset, offset = offset, offset + len(raw)
                where = f" (line at byte {line_offset})"
                line = _decode(path, raw, where).strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}{where}: not a JSON line ({e.msg}); fix or remove it") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                    raise ConfigError(
                        f"{path}{where}: no string field {text_field!r}; set data.text_field to the field "
                        "that holds the text"
                    )
                if obj[text_field]:
                    yield Document(f"{rel}:{line_offset}", obj[text_field])
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}); check the file") from None


def _read_parquet(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{path}: reading .parquet files needs the pyarrow package; `pip install pyarrow` "
            "or convert the data to .jsonl"
        ) from None
    try:
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise ConfigError(
                f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                "set data.text_field"
            )
        row = 0
        for batch in pf.iter_batches(columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text:
                    yield Document(f"{rel}:{row}", str(text))
                row += 1
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise ConfigError(f"{path}: not a readable parquet file ({e}); fix or remove it") from None


def file_documents(pattern: str, text_field: str, split: str) -> Iterator[Document]:
    """Documents of the `files` dataset under `pattern` that belong to `split`, in sorted file order."""
    check_split(split)
    root, files = find_files(pattern)
    for path in files:
        for doc in read_documents(path, root, text_field):
            if split_of(doc.key) == split:
                yield doc


def jsonl_chunks(path: Path, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split a .jsonl file into byte ranges of about `chunk_bytes` that start at line starts."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk_bytes < size:
            f.seek(bounds[-1] + chunk_bytes)
            f.readline()
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return list(zip(bounds[:-1], bounds[1:]))


# ----------------------------------------------------------------------------------------------
# hf: Hugging Face datasets streaming


def hf_documents(name: str, text_field: str, split: str) -> Iterator[Document]:
    """Documents of a Hugging Face dataset's train split, streamed, filtered to `split` by key hash.

    Raises:
        ConfigError: at once, when the `datasets` package is missing or the dataset cannot be opened.
    """
    check_split(split)
    if not name:
        raise ConfigError("data.dataset = 'hf' needs data.path = the dataset name (e.g. 'allenai/c4')")
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError(
            "data.dataset = 'hf' needs the Hugging Face `datasets` package and network access: "
            "`pip install datasets`, or use data.dataset = 'files' / 'shards' with local data"
        ) from None
    try:
        stream = datasets.load_dataset(name, split="train", streaming=True)
    except Exception as e:  # network, auth and name errors all end here
        raise ConfigError(f"data.path = {name!r}: cannot open the Hugging Face dataset ({e})") from None
    return _hf_rows(stream, name, text_field, split)


def _hf_rows(stream: Iterable[dict], name: str, text_field: str, split: str) -> Iterator[Document]:
    for i, row in enumerate(stream):
        text = row.get(text_field)
        if not isinstance(text, str):
            raise ConfigError(
                f"data.path = {name!r}: rows have no string field {text_field!r}; set data.text_field"
            )
        key = f"{name}:{i}"
        if text and split_of(key) == split:
            yield Document(key, text)
