"""`titanrush prepare`: tokenize text files once into binary shards for `data.dataset = "shards"`.

    titanrush prepare --input "corpus/**/*.jsonl" --output shards/ [--tokenizer default] [--workers N]

Output folder:
    index.json                 dtype, vocab size, tokenizer (spec and hash), BOS/EOS ids, and per split
                               the shard files with their token and document counts
    train_00000.bin ...        the split's tokens, documents back to back as `BOS ... EOS`
    train_00000.docs.npy       int64 document offsets into that shard (n_docs + 1 entries)
    validation_00000.bin ...   the held-out ~1% of documents (the same key hash as data.dataset = "files")

Files are tokenized in parallel worker processes (large .jsonl files in byte ranges); results are
written in input order, so the output does not depend on --workers. Everything is written to a
temporary folder that replaces --output only at the end: bad input leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Generator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from titanrush.cli import in_flags
from titanrush.config import ConfigError
from titanrush.data.corpus import INDEX_FILE, SHARD_FORMAT, SHARD_VERSION, frame, token_dtype
from titanrush.data.sources import SPLITS, find_files, jsonl_chunks, read_documents, split_of
from titanrush.data.tokenizer import Tokenizer, build_tokenizer
from titanrush.files import check_writable

WorkItem = tuple[str, str, str, str, int, int | None]  # tokenizer spec, root, file, text field, byte range
TokenizedItem = tuple[
    int, dict[str, tuple[np.ndarray, np.ndarray]]
]  # bytes read, split -> tokens, doc lengths


# The training config's keys that this tool's flags set (named so in its errors).
FLAGS = {"data.tokenizer": "--tokenizer", "data.text_field": "--text-field", "data.path": "--input"}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 for bad input, nothing written then)."""
    parser = argparse.ArgumentParser(prog="titanrush prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a file, folder or glob of .txt/.jsonl/.parquet files")
    parser.add_argument("--output", required=True, help="folder to write the shards and index.json to")
    parser.add_argument(
        "--tokenizer",
        default="default",
        help="'default', a tiktoken rank file, a tokenizer.json or a tokenizer folder (data.tokenizer)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    parser.add_argument("--text-field", default="text", help="field with the text in .jsonl/.parquet")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (about)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing shard folder")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        index = prepare(
            args.input,
            args.output,
            tokenizer_spec=args.tokenizer,
            workers=args.workers,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            overwrite=args.overwrite,
        )
    except ConfigError as e:
        print(f"titanrush prepare: error: {in_flags(str(e), FLAGS)}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    splits = index["splits"]
    n_tokens = sum(s["tokens"] for s in splits.values())
    n_docs = sum(s["documents"] for s in splits.values())
    print(
        f"wrote {args.output}: {n_tokens:,} tokens ({index['dtype']}) in {n_docs:,} documents "
        f"(validation: {splits['validation']['tokens']:,} tokens); {elapsed:.1f}s, "
        f"{n_tokens / max(elapsed, 1e-9):,.0f} tokens/s"
    )
    return 0


def prepare(
    input: str,
    output: str,
    *,
    tokenizer_spec: str = "default",
    workers: int = 1,
    text_field: str = "text",
    shard_tokens: int = 1 << 28,
    overwrite: bool = False,
    progress: bool = True,
    jsonl_chunk_bytes: int = 16 << 20,
) -> dict[str, Any]:
    """Tokenize `input` into shards under `output`; returns the index written.

    Raises:
        ConfigError: bad input (nothing is written then).
    """
    if workers < 1 or shard_tokens < 1:
        raise ConfigError(f"--workers ({workers}) and --shard-tokens ({shard_tokens}) must be >= 1")
    out = Path(output).expanduser()
    _check_output(out, overwrite)
    tokenizer = build_tokenizer(tokenizer_spec)
    root, files = find_files(input, key="--input")
    items: list[WorkItem] = []
    for path in files:
        ranges = jsonl_chunks(path, jsonl_chunk_bytes) if path.suffix == ".jsonl" else [(0, None)]
        items += [(tokenizer_spec, str(root), str(path), text_field, lo, hi) for lo, hi in ranges]

    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        index = _write_shards(tmp, items, files, tokenizer, workers, shard_tokens, progress)
        index.update(input=input, text_field=text_field)
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
        if out.exists():  # (--overwrite) moved aside, not deleted, until the new folder is in place
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException as e:
        if old.exists() and not out.exists():  # the old shards back in place
            with contextlib.suppress(OSError):
                os.replace(old, out)
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # folders made for the output, innermost first
            if p.exists() and not any(p.iterdir()):
                p.rmdir()
        if isinstance(e, OSError):  # (reading the input raises ConfigError: this is a write)
            raise ConfigError(
                f"cannot write --output {out} ({e.strerror or e}); nothing was written: free some space, "
                "make the folder writable or choose another --output"
            ) from None
        raise
    shutil.rmtree(old, ignore_errors=True)
    return index


def _check_output(out: Path, overwrite: bool) -> None:
    """Refuse an --output that prepare cannot write or must not replace, before any work.

    A new or empty folder is written; an existing shard folder (one with index.json) only with
    `overwrite`; anything else never (a file, a folder of other files, a folder that cannot be written).
    """
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--output {out} is a file, not a folder: choose a new folder for the shards")
        if out.is_dir() and any(out.iterdir()):
            if not (out / INDEX_FILE).is_file():
                raise ConfigError(
                    f"--output {out} is a folder of other files (no {INDEX_FILE}, so not shards that "
                    "--overwrite may replace): choose a new or empty folder"
                )
            if not overwrite:
                raise ConfigError(
                    f"--output {out} already holds shards; choose a new folder or pass --overwrite to "
                    "replace them"
                )
        problem = check_writable(out.parent)  # (the shards are written beside it, then renamed)
    except OSError as e:  # a folder that cannot be listed
        problem = f"{out} cannot be read ({e.strerror or e})"
    if problem:
        raise ConfigError(f"cannot write --output {out}: {problem}; choose an --output in a writable folder")


def _write_shards(
    folder: Path,
    items: list[WorkItem],
    files: list[Path],
    tokenizer: Tokenizer,
    workers: int,
    shard_tokens: int,
    progress: bool,
) -> dict[str, Any]:
    dtype = token_dtype(tokenizer.n_words)
    writers = {s: _ShardWriter(folder, s, dtype, shard_tokens) for s in SPLITS}
    total_bytes = sum(p.stat().st_size for p in files)
    bar = _Progress(total_bytes, enabled=progress)
    results = _tokenize_all(items, workers)
    try:
        for n_bytes, per_split in results:
            for split, (tokens, lens) in per_split.items():
                writers[split].add(tokens, lens)
            bar.update(n_bytes, sum(len(t) for t, _ in per_split.values()))
    finally:
        results.close()  # on error: cancel queued items and wait for the running ones
    splits = {s: w.close() for s, w in writers.items()}
    bar.finish()
    if splits["train"]["documents"] == 0:
        raise ConfigError(f"--input: no text in the train split of {len(files)} file(s); add documents")
    return {
        "format": SHARD_FORMAT,
        "version": SHARD_VERSION,
        "dtype": dtype.name,
        "vocab_size": tokenizer.n_words,
        "tokenizer": tokenizer.spec,
        "tokenizer_hash": tokenizer.hash,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "splits": splits,
    }


def _tokenize_all(items: list[WorkItem], workers: int) -> Generator[TokenizedItem, None, None]:
    """`_tokenize_item` over `items`, in input order, in up to `workers` processes.

    At most two items per worker are in flight, which bounds memory when writing is slower.
    """
    workers = min(workers, len(items))
    if workers <= 1:
        yield from map(_tokenize_item, items)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        todo = iter(items)
        pending = deque(pool.submit(_tokenize_item, item) for item in itertools.islice(todo, 2 * workers))
        try:
            while pending:
                result = pending.popleft().result()
                for item in itertools.islice(todo, 1):
                    pending.append(pool.submit(_tokenize_item, item))
                yield result
        finally:
            for future in pending:
                future.cancel()


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(spec: str) -> Tokenizer:
    return build_tokenizer(spec)


def _tokenize_item(item: WorkItem) -> TokenizedItem:
    """Tokenize one file (or byte range): (bytes read, split -> (framed tokens, document lengths))."""
    spec, root, file, text_field, lo, hi = item
    tok = _worker_tokenizer(spec)
    path = Path(file)
    texts: dict[str, list[str]] = {s: [] for s in SPLITS}
    for doc in read_documents(path, Path(root), text_field, lo, hi):
        texts[split_of(doc.key)].append(doc.text)
    n_bytes = (hi if hi is not None else path.stat().st_size) - lo
    dtype = token_dtype(tok.n_words)
    out = {
        s: frame(tok.encode_arrays(t, num_threads=1), tok.bos_id, tok.eos_id, dtype)
        for s, t in texts.items()
        if t
    }
    return n_bytes, out


class _ShardWriter:
    """Appends whole documents to `<split>_NNNNN.bin`, starting a new shard past `shard_tokens`."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._name = ""
        self._offsets: list[int] = [0]
        self._max_id = -1

    def add(self, tokens: np.ndarray, lens: np.ndarray) -> None:
        """Append documents (`tokens` back to back, `lens` their lengths)."""
        while len(lens):
            room = self.shard_tokens - self._offsets[-1]
            k = int(np.searchsorted(np.cumsum(lens), room, side="right"))
            if k == 0 and self._offsets[-1] == 0:
                k = 1  # a document longer than a shard gets a shard of its own
            if k == 0:
                self._roll()
                continue
            n = int(lens[:k].sum())
            self._write(tokens[:n], lens[:k])
            tokens, lens = tokens[n:], lens[k:]
            if len(lens):
                self._roll()

    def _write(self, tokens: np.ndarray, lens: np.ndarray) -> None:
        if not self._name:
            self._name = f"{self.split}_{len(self.shards):05d}"
        with open(self.folder / f"{self._name}.bin", "ab") as f:
            f.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._offsets.extend((self._offsets[-1] + np.cumsum(lens)).tolist())
        self._max_id = max(self._max_id, int(tokens.max()))

    def _roll(self) -> None:
        if not self._name:
            return
        np.save(self.folder / f"{self._name}.docs.npy", np.asarray(self._offsets, np.int64))
        self.shards.append(
            {
                "file": f"{self._name}.bin",
                "offsets": f"{self._name}.docs.npy",
                "tokens": self._offsets[-1],
                "documents": len(self._offsets) - 1,
                "max_token_id": self._max_id,
            }
        )
        self._name, self._offsets, self._max_id = "", [0], -1

    def close(self) -> dict[str, Any]:
        """Finish the last shard; the split's entry for the index."""
        self._roll()
        return {
            "tokens": sum(s["tokens"] for s in self.shards),
            "documents": sum(s["documents"] for s in self.shards),
            "shards": self.shards,
        }


class _Progress:
    """A one-line progress bar on stderr (redrawn at most 10 times a second)."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.total, self.enabled = max(total_bytes, 1), enabled
        self.bytes = self.tokens = 0
        self.start = self.last = time.perf_counter()

    def update(self, n_bytes: int, n_tokens: int) -> None:
        self.bytes += n_bytes
        self.tokens += n_tokens
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.1 or self.bytes >= self.total):
            self.last = now
            frac = min(self.bytes / self.total, 1.0)
            bar = "#" * int(frac * 30)
            rate = self.tokens / max(now - self.start, 1e-9)
            sys.stderr.write(
                f"\rprepare [{bar:<30}] {frac:4.0%} {self.bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
                f"{rate / 1e6:.2f}M tokens/s"
            )
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
