"""A stand-in for the parts of Hugging Face `datasets` that torchtitan's text loader imports.

side_by_side.py puts it on torchtitan's path where the real package is not importable (the GPU machine
lacks it, and its pyarrow wheel alone is near the transfer limit). torchtitan's own dataset, tokenizer
and loader do the work; this reads JSON lines of {"text": ...} (a .jsonl file or a folder of them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class Dataset:
    """A list of records with the two methods torchtitan calls besides iteration: len and skip."""

    def __init__(self, records: list[dict]) -> None:
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[dict]:
        return iter(self._records)

    def skip(self, n: int) -> Dataset:
        return Dataset(self._records[n:])


def load_dataset(path: str, split: str = "train", **_: object) -> Dataset:
    """All records of the .jsonl file at `path`, or of every .jsonl file in the folder `path`."""
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no .jsonl records at {path}")
    return Dataset([json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()])
