"""A stand-in for the parts of Hugging Face `datasets` that torchtitan's text loader imports.

Used by scripts/side_by_side.py only where the real package is not importable (on the GPU machine it
is not installed, and its pyarrow wheel alone is near the transfer limit). torchtitan's own
HuggingFaceTextDataset, tokenizer and ParallelAwareDataloader still do all the work; this only reads
a JSON-lines file of {"text": ...} records (`load_dataset(path)` with a directory or a .jsonl file) and
hands each data-parallel rank every world-size-th record.
"""

from __future__ import annotations

import json
from pathlib import Path


class Dataset:
    """A map-style list of records (dicts) with the two methods torchtitan calls: len and skip."""

    def __init__(self, records: list[dict]):
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self):
        return iter(self._records)

    def skip(self, n: int) -> Dataset:
        return Dataset(self._records[n:])


def load_dataset(path: str, split: str = "train", **_: object) -> Dataset:
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no .jsonl records at {path}")
    records = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    return Dataset(records)
