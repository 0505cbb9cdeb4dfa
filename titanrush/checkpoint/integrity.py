"""The integrity record of a checkpoint: every file's size and CRC-32 checksums, written with each save and
verified before a load reads anything.

`integrity.json` in a `step-<N>` folder lists each file with its size and one CRC-32 per block of
`BLOCK_BYTES` (per block, so that one large file is checked by several threads at once, and a mismatch
says where in the file it is). CRC-32 (zlib) runs at about 2.4 GB/s per core and releases the GIL, so a
rank checks its share of the blocks with a few threads (`hash_threads`).

Writing: `IntegrityWriter` is DCP's `FileSystemWriter` plus one thing: after a rank has written its files
(in `write_data`, so on the background thread of an async save), it checksums them, and DCP's own
gathering of the write results carries the checksums to the coordinator (rank 0), which keeps them for
the manager to write beside `titanrush.json` before the folder is renamed. No extra collective, and no
rank reads another rank's files.

Verifying: every rank stats every file (sizes) and checksums every `world_size`-th block; the manager
gathers the findings so that every rank raises the same error. `read_record` is the one reader of the
record and checks its shape (a record edited by hand is refused as such, never a KeyError in `verify`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

RECORD_FILE = "integrity.json"
ALGORITHM = "crc32"
BLOCK_BYTES = 64 * 2**20
RECORD_VERSION = 1
_MARK = "titanrush.integrity"  # the write result that carries a rank's checksums (never in .metadata)


def hash_threads() -> int:
    """Threads one rank uses to checksum: its share of this host's CPUs, at most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return max(1, min(16, cpus // local))


_CHUNK = 16 * 2**20
_buffers = threading.local()  # one read buffer per thread: no allocation (and page faults) per read


def _crc_range(path: Path, offset: int, length: int) -> str:
    """CRC-32 (hex) of `length` bytes of the file from `offset`; pread, so threads share no file position."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = bytearray(_CHUNK)
    view = memoryview(buf)
    crc = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while length > 0:  # a read may return less than asked for
            n = os.preadv(fd, [view[: min(length, _CHUNK)]], offset)
            if n == 0:
                break  # the file shrank meanwhile: the size check reports it
            crc = zlib.crc32(view[:n], crc)
            offset += n
            length -= n
    finally:
        os.close(fd)
    return f"{crc:08x}"


def _n_blocks(size: int, block: int) -> int:
    return max(1, -(-size // block))


def checksum_files(folder: Path, names: Iterable[str], threads: int | None = None) -> dict[str, dict]:
    """{name: {"size", "crc32": [per block]}} of the files `names` of `folder`."""
    sizes = {name: (folder / name).stat().st_size for name in sorted(set(names))}
    jobs = [(name, i) for name, size in sizes.items() for i in range(_n_blocks(size, BLOCK_BYTES))]

    def crc(job: tuple[str, int]) -> str:
        name, i = job
        return _crc_range(folder / name, i * BLOCK_BYTES, min(BLOCK_BYTES, sizes[name] - i * BLOCK_BYTES))

    with ThreadPoolExecutor(max_workers=threads or hash_threads()) as pool:
        crcs = list(pool.map(crc, jobs))
    out: dict[str, dict] = {name: {"size": size, ALGORITHM: []} for name, size in sizes.items()}
    for (name, _), crc in zip(jobs, crcs):
        out[name][ALGORITHM].append(crc)
    return out


def write_record(folder: Path, files: dict[str, dict]) -> None:
    """Write `integrity.json` (synced) into folder."""
    record = {"version": RECORD_VERSION, "algorithm": ALGORITHM, "block_bytes": BLOCK_BYTES, "files": files}
    path = folder / RECORD_FILE
    with open(path, "w") as f:
        json.dump(record, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_record(folder: Path) -> dict[str, Any] | None:
    """The folder's record, None where it has none. Its shape is checked here, so what reads it need not.

    Raises:
        ValueError: The record exists but cannot be read, is not JSON, or is not a record of this shape;
            the message starts with the file's name and says what is wrong (the caller calls the
            checkpoint corrupt).
    """
    return read_checked_json(folder / RECORD_FILE, record_problem)


def read_checked_json(path: Path, problem_of: Callable[[Any], str]) -> Any:
    """The JSON in path, None where there is no such file; `problem_of(value)` says what is wrong with
    its shape ('' for nothing). Raises ValueError starting with the file's name otherwise."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path.name} cannot be read ({e.strerror or e})") from e
    if not text.strip():
        raise ValueError(f"{path.name} is empty ({len(text)} bytes)")
    try:
        value = json.loads(text)
    except ValueError as e:  # (JSONDecodeError and UnicodeDecodeError)
        raise ValueError(f"{path.name} is not valid JSON ({e})") from e
    if problem := problem_of(value):
        raise ValueError(f"{path.name} {problem}")
    return value


def whole(value: Any) -> bool:
    """Whether a JSON value is a whole number (JSON's true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_name(name: str) -> bool:
    """A file name of the folder itself (no path, so that a record never points outside its folder)."""
    return bool(name) and name not in (".", "..", RECORD_FILE) and "/" not in name and "\\" not in name


def record_problem(record: Any) -> str:
    """What makes `record` not an integrity record as `write_record` writes one ('' if nothing): the
    fields and types that `verify` relies on, and one checksum per block of each file."""
    if not isinstance(record, dict):
        return f"is not a JSON object (it holds a {type(record).__name__})"
    lacks = [k for k in ("algorithm", "files") if k not in record]
    if lacks:
        return f"is not a titanrush integrity record (it lacks {' and '.join(map(repr, lacks))})"
    if record["algorithm"] != ALGORITHM:
        return f"names the algorithm {json.dumps(record['algorithm'])}, not {ALGORITHM!r}"
    block = record.get("block_bytes", BLOCK_BYTES)
    if not whole(block) or block <= 0:
        return f"has block_bytes {json.dumps(block)}, not a positive whole number"
    files = record["files"]
    if not isinstance(files, dict):
        return f"has files {json.dumps(files)[:60]}, not an object of the files' sizes and checksums"
    if not files:
        return "lists no files"
    for name, entry in files.items():
        if not _plain_name(name):
            return f"lists {name!r}, which is not a file name of the checkpoint folder"
        if not isinstance(entry, dict):
            return f"has {json.dumps(entry)[:60]} for {name}, not its size and checksums"
        if lacks := [k for k in ("size", ALGORITHM) if k not in entry]:
            return f"lacks the {' and '.join(lacks)} of {name}"
        size, crcs = entry["size"], entry[ALGORITHM]
        if not whole(size) or size < 0:
            return f"gives {name} the size {json.dumps(size)}, not a number of bytes"
        n = _n_blocks(size, block)
        if not isinstance(crcs, list) or len(crcs) != n:
            listed = isinstance(crcs, list)
            got = f"{len(crcs)} {ALGORITHM} checksum(s)" if listed else f"{ALGORITHM} {json.dumps(crcs)[:40]}"
            want = n if listed else f"a list of {n} checksum(s)"
            return f"has {got} for {name}, not {want} (one per block of its {size:,} bytes)"
        if not all(isinstance(c, str) and re.fullmatch(r"[0-9a-f]{8}", c) for c in crcs):
            return f"has a {ALGORITHM} checksum for {name} that is not 8 hex digits"
    return ""


def verify(
    folder: Path, record: dict[str, Any], *, rank: int = 0, world_size: int = 1, quick: bool = False
) -> list[str]:
    """This rank's findings: every file's presence and size, every `world_size`-th block's CRC-32, and
    DCP files in the folder that the record does not list. `record` is one that `read_record` returned.

    Args:
        quick: Sizes, and of the checksums only those of the one-block files (the small ones:
            `.metadata`, `titanrush.json`), every rank all of them: the check before anything reads them.

    Returns:
        One line per problem (missing file, wrong size, block checksum mismatch); empty when all match.
    """
    block = record.get("block_bytes", BLOCK_BYTES)
    files = record["files"]
    problems = [
        f"{p.name} is not in {RECORD_FILE}"
        for p in sorted(folder.iterdir())
        if (p.name == ".metadata" or p.name.endswith(".distcp")) and p.name not in files
    ]
    jobs = []
    for name, entry in sorted(files.items()):
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != entry["size"]:
            problems.append(f"{name} has {size:,} bytes, the record says {entry['size']:,}")
            continue
        if not quick or len(entry[ALGORITHM]) == 1:
            jobs += [(name, i, size, crc) for i, crc in enumerate(entry[ALGORITHM])]

    def check(job: tuple[str, int, int, str]) -> str:
        name, i, size, want = job
        start, end = i * block, min((i + 1) * block, size)
        got = _crc_range(folder / name, start, end - start)
        return "" if got == want else f"{name} bytes {start:,}-{end:,} differ (crc32 {got}, recorded {want})"

    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        problems += [p for p in pool.map(check, jobs if quick else jobs[rank::world_size]) if p]
    return problems


class IntegrityWriter(StorageWriter):
    """DCP's `FileSystemWriter`, whose ranks also checksum the files they wrote.

    After a save, on the coordinator, `files` holds every rank's checksums (None where a rank could not
    name its files; the manager then checksums the folder itself) and `hash_s` this rank's checksum time.
    Composition rather than a subclass: `FileSystemWriter` is also an async stager, and DCP would stage
    through it instead of the stager it picks for the async modes.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.inner = FileSystemWriter(path)
        self.files: dict[str, dict] | None = None
        self.hash_s = 0.0
        self.incomplete = False  # some rank's files were not named in its write results

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.inner.checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.inner.reset(checkpoint_id)
        self.files, self.hash_s, self.incomplete = None, 0.0, False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.inner.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = self.inner.write_data(plan, planner).wait()
        t0 = time.perf_counter()
        names = {getattr(r.storage_data, "relative_path", None) for r in results}
        files = None if None in names else checksum_files(Path(self.inner.checkpoint_id), names)
        self.hash_s = time.perf_counter() - t0
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, WriteResult(MetadataIndex(_MARK), 0, files)])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, dict] = {}
        kept = []
        for rank_results in results:
            kept.append([r for r in rank_results if r.index.fqn != _MARK])
            for r in rank_results:
                if r.index.fqn == _MARK:
                    if r.storage_data is None:
                        self.incomplete = True
                    else:
                        files.update(r.storage_data)
        self.files = files
        self.inner.finish(metadata, kept)

    def storage_meta(self) -> Any:
        return self.inner.storage_meta()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)


def record_folder(folder: Path, writer: IntegrityWriter | None = None) -> float:
    """Write the record of a finished save into `folder`: the ranks' checksums from `writer`, plus the
    files written after DCP's (`.metadata`, `titanrush.json`); every file where the writer has none.

    Returns:
        Seconds spent checksumming here.
    """
    t0 = time.perf_counter()
    files = dict(writer.files or {}) if writer is not None and not writer.incomplete else {}
    rest = [p.name for p in folder.iterdir() if p.is_file() and p.name != RECORD_FILE and p.name not in files]
    files.update(checksum_files(folder, rest))
    write_record(folder, files)
    return time.perf_counter() - t0
