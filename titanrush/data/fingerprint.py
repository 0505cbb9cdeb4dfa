"""A fingerprint of the data a run reads, so that a resume can tell that the data changed underfoot.

A checkpoint's data position counts windows of one token stream; the same position in another stream
(a shard overwritten, a corpus edited or re-prepared at the same path) continues silently on other
tokens. `fingerprint` records each file of the train split: its name (relative to the data's root, so
moved data still matches), size and modification time, and a CRC-32 of sampled blocks: the first and
the last `BLOCK` bytes and `SAMPLES` blocks evenly spaced between, so about 640 KiB are read per file
whatever its size (a file that small is read whole): a terabyte in 2,000 shards of 512 MiB reads about
1.3 GB. `full` also takes a CRC-32 of every byte. `changes` compares two fingerprints: files added or removed,
another size, other bytes. The modification time decides nothing (a copy or a `touch` gives the same
bytes a new one); where only it differs, `changes` says so as a note.

What is fingerprinted: `files`, every data file under data.path; `shards`, the train split's shard and
document-offset files; `embedded`, the train split's standard-library files by size alone (they change
only with the Python installation). `synthetic` and `hf` data have no files to fingerprint (None).
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from titanrush.config import ConfigError, Data
from titanrush.data import sources
from titanrush.data.corpus import INDEX_FILE

logger = logging.getLogger(__name__)

BLOCK = 64 * 2**10
"""Bytes in one sampled block."""
SAMPLES = 8
"""Blocks sampled between the first and the last one."""
METHOD = f"crc32 of the first, the last and {SAMPLES} evenly spaced blocks of {BLOCK} bytes"
"""How the sampled checksums were taken (two fingerprints' samples compare only under the same method)."""
_CHUNK = 16 * 2**20  # bytes read at a time for a full checksum
_THREADS = 8  # files read at once (reading and zlib release the GIL; a network file system wants several)


def fingerprint(cfg: Data) -> dict[str, Any] | None:
    """The fingerprint of the train data that `cfg` names, as titanrush.json records it.

    Returns:
        `{"dataset", "method", "full", "files": {name: {"size", "mtime_ns", "sampled", "crc32"}}}` (an
        entry has `sampled` where its bytes are sampled, `crc32` with `cfg.fingerprint = "full"`); None for
        synthetic and hf data.

    Raises:
        ConfigError: a data file cannot be read (naming it).
    """
    named = data_files(cfg)
    if named is None:
        return None
    files, sample = named
    full = cfg.fingerprint == "full"
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(_THREADS, max(len(files), 1))) as pool:
        entries = list(pool.map(lambda nf: _entry(nf[1], sample=sample, full=full), files))
    if full:
        total = sum(e["size"] for e in entries)
        logger.info(
            "data fingerprint: every byte of %d files (%.1f GB) in %.1f s",
            len(files),
            total / 1e9,
            time.perf_counter() - t0,
        )
    return {
        "dataset": cfg.dataset,
        "method": METHOD if sample else "sizes",
        "full": full,
        "files": {name: e for (name, _), e in zip(files, entries)},
    }


def data_files(cfg: Data) -> tuple[list[tuple[str, Path]], bool] | None:
    """([(name, path)] of the files the train split reads, whether their bytes are sampled); None for
    data without files (synthetic, hf)."""
    if cfg.dataset == "files":
        root, paths = sources.find_files(cfg.path)
        return [(_name(p, root), p) for p in paths], True
    if cfg.dataset == "shards":
        return _shard_files(cfg.path), True
    if cfg.dataset == "embedded":
        root, _ = sources.stdlib_files()
        return [(_name(p, root), p) for p in sources.embedded_files("train")], False
    return None


def _name(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def _shard_files(path: str) -> list[tuple[str, Path]]:
    """The train split's shard and document-offset files, as the shard index lists them."""
    folder = Path(path).expanduser()
    index_path = folder / INDEX_FILE if folder.is_dir() or not folder.suffix else folder
    try:
        shards = json.loads(index_path.read_text())["splits"]["train"]["shards"]
        names = [name for shard in shards for name in (shard["file"], shard["offsets"])]
    except (OSError, ValueError, KeyError, TypeError) as e:  # (the loader has read it already: a race)
        raise ConfigError(f"{index_path}: cannot be read ({e}); check the shard folder") from None
    return [(name, index_path.parent / name) for name in names]


def _entry(path: Path, *, sample: bool, full: bool) -> dict[str, Any]:
    """One file's size and modification time, and its sampled (and full) CRC-32."""
    try:
        st = path.stat()
        entry: dict[str, Any] = {"size": st.st_size}
        if not sample and not full:
            return entry
        entry["mtime_ns"] = st.st_mtime_ns
        with open(path, "rb") as f:
            if sample:
                entry["sampled"] = _sampled_crc(f, st.st_size)
            if full:
                entry["crc32"] = _full_crc(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e}); check the data file") from None
    return entry


def sample_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks sampled from a file of `size` bytes: the whole file when it is no
    larger than the blocks together, else the first, the last and SAMPLES evenly spaced between."""
    if size <= BLOCK * (SAMPLES + 2):
        return [(0, size)]
    last = size - BLOCK
    return [(last * i // (SAMPLES + 1), BLOCK) for i in range(SAMPLES + 2)]


def _sampled_crc(f: Any, size: int) -> str:
    crc = 0
    for offset, length in sample_ranges(size):
        f.seek(offset)
        crc = zlib.crc32(f.read(length), crc)
    return f"{crc:08x}"


def _full_crc(f: Any) -> str:
    f.seek(0)
    crc = 0
    while chunk := f.read(_CHUNK):
        crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


# ----------------------------------------------------------------------------------------------
# Comparing


def changes(saved: dict[str, Any], here: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What differs between the fingerprint a checkpoint recorded (`saved`) and this run's (`here`).

    Returns:
        (changes: files removed and added, then each file of another size or other bytes, one line each;
        notes: what was not compared, or only the modification times differ). Two fingerprints of
        different datasets are not compared (the data position's own check names that).
    """
    if saved.get("dataset") != here.get("dataset"):
        return [], []
    before, now = _files(saved), _files(here)
    out: list[str] = []
    removed = [n for n in before if n not in now]
    added = [n for n in now if n not in before]
    if removed:
        out.append(f"{_count(removed)} removed ({_names(removed)})")
    if added:
        out.append(f"{_count(added)} added ({_names(added)})")
    same_method = saved.get("method") == here.get("method")
    touched = 0
    for name in (n for n in before if n in now):
        a, b = before[name], now[name]
        if a.get("size") != b.get("size"):
            out.append(f"{name} has {_bytes(b.get('size'))} bytes, {_bytes(a.get('size'))} at the save")
        elif "crc32" in a and "crc32" in b and a["crc32"] != b["crc32"]:
            out.append(f"{name} has other bytes at the same size (its CRC-32 differs)")
        elif same_method and "sampled" in a and "sampled" in b and a["sampled"] != b["sampled"]:
            out.append(f"{name} has other bytes at the same size (sampled blocks differ)")
        elif a.get("mtime_ns") != b.get("mtime_ns") and not ("crc32" in a and "crc32" in b):
            touched += 1
    notes = []
    if not same_method:
        notes.append(
            f"the data fingerprint was taken as '{saved.get('method')}' at the save, '{here.get('method')}' "
            "now: only the files and their sizes are compared"
        )
    elif here.get("full") and not saved.get("full"):
        notes.append(
            "the checkpoint's data fingerprint has sampled checksums only: compared those (every byte is "
            "compared from the next checkpoint on)"
        )
    if touched and not out:
        notes.append(
            f"{_count(touched)} of the data changed only the modification time (the same size and sampled "
            "bytes): taken as unchanged (data.fingerprint = 'full' compares every byte)"
        )
    return out, notes


def _files(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    files = record.get("files")
    if not isinstance(files, dict):
        return {}
    return {str(k): v if isinstance(v, dict) else {} for k, v in files.items()}


def _count(items: list[str] | int) -> str:
    n = items if isinstance(items, int) else len(items)
    return f"{n:,} file" + ("" if n == 1 else "s")


def _names(names: list[str], limit: int = 3) -> str:
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f", ... {more:,} more" if more > 0 else "")


def _bytes(size: Any) -> str:
    return f"{size:,}" if isinstance(size, int) else str(size)
