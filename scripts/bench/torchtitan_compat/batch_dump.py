"""The token batches and weights that both trainers of a parity run are held to (side_by_side.py --parity).

The parity mode writes, before either trainer starts, the token batches titanrush's loader yields for the
run's steps (each data-parallel rank's inputs and labels) into a dump folder (`write_dump`); torchtitan
reads them from there in order (`tt_parity`), titanrush reads its own loader. Each trainer writes the hash
of every micro-batch its train step draws (`batch_hash`, one JSON line per step and rank: `HashLog`), and
the hash of every weight it starts from (`weight_hashes`, Hugging Face names), which the report holds
against the dump's and the exported weights'.

torch and numpy only: torchtitan's processes, titanrush's (parity_observe.py) and the driver import it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

INPUTS, LABELS, META = "inputs.npy", "labels.npy", "meta.json"


def _int64(x: torch.Tensor | np.ndarray) -> np.ndarray:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return np.ascontiguousarray(a, dtype=np.int64)


def batch_hash(inputs: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> str:
    """A micro-batch's identity: SHA-256 of its inputs and labels (B, T) as int64, shapes included."""
    h = hashlib.sha256()
    for x in (inputs, labels):
        a = _int64(x)
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def tensor_hash(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (bitwise identity)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())  # (the buffer itself, no copy)
    return h.hexdigest()[:16]


def weight_hashes(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name: tensor_hash} of a (Hugging Face) state dict, sorted by name; hashed on 8 threads (hashlib
    lets go of the GIL on large buffers: a 1B model's 6 GB take seconds)."""
    names = sorted(state_dict)
    with ThreadPoolExecutor(8) as pool:
        return dict(zip(names, pool.map(tensor_hash, (state_dict[k] for k in names))))


def write_dump(folder: Path, steps: Sequence[Sequence[tuple[Any, Any]]]) -> dict[str, Any]:
    """Write steps[s][r] = (inputs, labels) of data-parallel rank r at step s + 1; return the metadata.

    Token ids are stored as int32 (steps, ranks, batch, seq_len) arrays; meta.json holds the shape and
    each batch's `batch_hash`.
    """
    inputs = np.stack([np.stack([_int64(x) for x, _ in ranks]) for ranks in steps])
    labels = np.stack([np.stack([_int64(y) for _, y in ranks]) for ranks in steps])
    if inputs.shape != labels.shape or inputs.ndim != 4:
        raise ValueError(f"inputs {inputs.shape} and labels {labels.shape}: expected (steps, ranks, B, T)")
    if max(np.abs(inputs).max(), np.abs(labels).max()) >= 2**31:
        raise ValueError("token ids do not fit int32")
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / INPUTS, inputs.astype(np.int32))
    np.save(folder / LABELS, labels.astype(np.int32))
    n_steps, ranks, batch, seq_len = inputs.shape
    meta = {
        "steps": n_steps,
        "ranks": ranks,
        "batch": batch,
        "seq_len": seq_len,
        "hashes": [[batch_hash(x, y) for x, y in ranks_] for ranks_ in steps],
    }
    (folder / META).write_text(json.dumps(meta) + "\n")
    return meta


class DumpReader:
    """The batches of a dump folder, memory-mapped; `batch(step, rank)` (step from 1) as int64 tensors."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / META).read_text())
        self.inputs = np.load(self.folder / INPUTS, mmap_mode="r")
        self.labels = np.load(self.folder / LABELS, mmap_mode="r")
        self.steps, self.ranks = self.meta["steps"], self.meta["ranks"]
        self.local_batch, self.seq_len = self.meta["batch"], self.meta["seq_len"]

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of data-parallel rank `rank` at step `step` (1-based)."""
        i = step - 1
        return torch.from_numpy(_int64(self.inputs[i, rank])), torch.from_numpy(_int64(self.labels[i, rank]))


class HashLog:
    """Appends one JSON object per line to a file, flushed at once (a run cut short keeps its lines)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "w")  # noqa: SIM115 (open for the life of the run)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def read_lines(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The JSON objects of every line of the files that exist (a torn last line dropped)."""
    out = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
