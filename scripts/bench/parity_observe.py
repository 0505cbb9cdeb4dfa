"""titanrush's side of a parity run (side_by_side.py --parity): `titanrush.train`, observed.

    python scripts/bench/parity_observe.py --parity-out DIR [--lr-schedule torchtitan] [titanrush flags]

(under torchrun for several GPUs). Runs `titanrush.train` as it is, with two observers around
`Trainer.train_step`: each rank writes the hash of every micro-batch the step draws from its loader
(DIR/tokens_rank<r>.jsonl), and before the first step rank 0 writes the hash of every weight the run starts
from, under the names of the parity export (DIR/weights.json).

`--lr-schedule torchtitan` is the one change it can make, for the ablation that measures the one setting
the two trainers cannot share: the learning-rate factor of step k becomes titanrush's factor of step k - 1
after the warm-up, with the peak at step warmup + 1, which is torchtitan 0.2.2's schedule (one step at the
peak, then the same decay one step later; titanrush reaches the minimum at the last step).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent / "torchtitan_compat")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from batch_dump import HashLog, batch_hash, weight_hashes  # noqa: E402
from parity import export_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from titanrush import optim, trainer  # noqa: E402
from titanrush.cli import exit_program  # noqa: E402
from titanrush.train import main as train_main  # noqa: E402


def torchtitan_schedule(factor: Callable[..., float]) -> Callable[..., float]:
    """torchtitan 0.2.2's learning-rate factor from titanrush's `factor` (`titanrush.optim.lr_factor`):
    the same warm-up, then 1 for one step, then the decay one step later."""

    def shifted(step: int, *, warmup_steps: int, **kwargs: Any) -> float:
        if step <= warmup_steps:
            return factor(step, warmup_steps=warmup_steps, **kwargs)
        if step == warmup_steps + 1:
            return 1.0
        return factor(step - 1, warmup_steps=warmup_steps, **kwargs)

    return shifted


class Hashed:
    """An iterator of Batches that writes the hash of each one it hands out."""

    def __init__(self, batches: Iterator[Any], log: HashLog, step: int, dp_rank: int) -> None:
        self.batches, self.log, self.step, self.dp_rank, self.micro = batches, log, step, dp_rank, 0

    def __iter__(self) -> Hashed:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        self.micro += 1
        record = {"step": self.step, "dp_rank": self.dp_rank, "micro": self.micro}
        self.log.write(record | {"hash": batch_hash(batch.input_ids, batch.labels)})
        return batch


@torch.no_grad()
def write_weight_hashes(model: torch.nn.Module, args: Any, path: Path) -> None:
    """Rank 0 writes {export name: hash} of the model's full weights (every rank gathers its shards)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    full = {}
    for name, value in get_model_state_dict(model).items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        if rank0:
            full[name] = tensor.detach().cpu()
    if rank0:
        HashLog(path).write(weight_hashes(export_state_dict(full, args)))


def observe(out: Path) -> None:
    """Wrap `Trainer.train_step` with the two observers (the module docstring)."""
    train_step = trainer.Trainer.train_step

    def observed(self: trainer.Trainer, data_iter: Iterator[Any]) -> Any:
        if not hasattr(self, "_parity_tokens"):  # the first step: the weights it starts from
            self._parity_tokens = HashLog(out / f"tokens_rank{self.rank}.jsonl")
            write_weight_hashes(self.model, self.plan.args, out / "weights.json")
        hashed = Hashed(data_iter, self._parity_tokens, self.step, self.loader_args["dp_rank"])
        return train_step(self, hashed)

    trainer.Trainer.train_step = observed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--parity-out", type=Path, required=True, help="where the hashes go")
    ap.add_argument("--lr-schedule", choices=("titanrush", "torchtitan"), default="titanrush")
    a, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    observe(a.parity_out)
    if a.lr_schedule == "torchtitan":
        optim.lr_factor = torchtitan_schedule(optim.lr_factor)
    return train_main(rest)


if __name__ == "__main__":
    exit_program(main)
