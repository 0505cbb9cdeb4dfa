"""Masked labels for the loss-normalization parity tests (test_masked_loss.py).

Labels are masked here, in the tests, and not by any dataset: titanrush's data layer masks no label today
(every window's labels are its next tokens), but the loss must be right for the masks that document
boundaries, padding or an `IGNORE_INDEX` in the data will bring. The mask depends on a window's tokens
alone, so every mesh masks the same tokens: a row whose first token id t has (t * 7919) % (2T) = c < T
loses its labels from position c on, the other rows keep all of theirs. The counts of valid tokens are
thus very uneven between micro-batches and ranks, which is what an average of per-micro-batch means
gets wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness import read_metrics, run_ok

from titanrush.models.llama.loss import IGNORE_INDEX

HERE = Path(__file__).resolve().parent


def mask_labels(batch: Any) -> Any:
    """The batch with the labels of some rows masked from a position on (see the module docstring)."""
    labels = batch.labels.clone()
    t = labels.shape[1]
    for row in range(labels.shape[0]):
        cut = int(batch.input_ids[row, 0]) * 7919 % (2 * t)
        if cut < t:
            labels[row, cut:] = IGNORE_INDEX
    return dataclasses.replace(batch, labels=labels)


class MaskedLoader:
    """A titanrush DataLoader whose batches come out with masked labels (state and length unchanged)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return (mask_labels(b) for b in self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def install_masking(set_attribute: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make the trainer's loaders (train and validation) mask labels, in this process (`set_attribute`:
    pytest's monkeypatch.setattr to undo it after a test)."""
    from titanrush import trainer

    build = trainer.build_dataloader
    set_attribute(trainer, "build_dataloader", lambda *a, **k: MaskedLoader(build(*a, **k)))


def run_masked(dump: Path, name: str, nproc: int, *args: str) -> list[dict]:
    """Train with masked labels in `nproc` processes (several: `harness.spawn`); rank 0's metrics rows."""
    entry = [str(HERE / "masked_train.py"), "--job.dump_folder", str(dump), "--job.name", name, *args]
    run_ok(entry, nproc)
    return read_metrics(dump / name)
