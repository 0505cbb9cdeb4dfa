"""flash-attn-4's kernels compiled in a process of their own, beside a run's start-up.

FA4 compiles each kernel at its first call: seconds of Python (the CuTe DSL builds its IR) that, on a
thread of the training process, hold the interpreter that the set-up needs (the 8B's set-up took 10-13 s
instead of 5 with the compile on a thread beside it). A child process compiles them at the training's
shapes instead and writes them to FA4's disk cache, from which the training process loads them at its
first call. `titanrush.train` starts the child right after reading the config (`start_at_launch`), before
its own imports of torch and the trainer, so the child's start-up runs beside the parent's; the child
then works its shapes out of the same config. Run as
`python -m titanrush.models.flash_warm_up '<shapes as JSON>'` or `... --from-config [train args]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch is imported by the child's work, not by train.py's launch)
    from titanrush.config import JobConfig
    from titanrush.models.llama.attention import FlashShapes

_AT_LAUNCH: WarmUpProcess | None = None  # the child that titanrush.train started, for the trainer to use


def enable_disk_cache() -> None:
    """FA4's disk cache of compiled kernels (read by FA4 when imported), on unless the environment says
    otherwise, as inductor's cache is: later runs load them, and a child's kernels reach the parent."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")


def disk_cache_enabled() -> bool:
    return os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1"


def to_json(shapes: FlashShapes) -> str:
    fields = dataclasses.asdict(shapes)
    fields.update(device=str(shapes.device), dtype=str(shapes.dtype).removeprefix("torch."))
    return json.dumps(fields)


def from_json(text: str) -> FlashShapes:
    import torch

    from titanrush.models.llama.attention import FlashShapes

    fields = json.loads(text)
    fields.update(device=torch.device(fields["device"]), dtype=getattr(torch, fields["dtype"]))
    return FlashShapes(**fields)


class WarmUpProcess:
    """The child that compiles the kernels at `shapes`, or at the shapes that the training arguments
    `train_argv` give this rank. `wait()` gives (None, the shapes it compiled, None where it had none)
    once it succeeded, else (why it failed: its exit status and the end of its stderr, None)."""

    def __init__(self, shapes: FlashShapes | None = None, *, train_argv: list[str] | None = None) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # titanrush importable wherever we run
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        args = ["--from-config", *train_argv] if train_argv is not None else [to_json(shapes)]
        self._out = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait()
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, *args],
            env={**os.environ, "PYTHONPATH": path},
            stdout=self._out,
            stderr=self._err,
        )

    def wait(self) -> tuple[str | None, FlashShapes | None]:
        code = self._proc.wait()
        self._out.seek(0)
        self._err.seek(0)
        lines = self._out.read().decode(errors="replace").strip().splitlines()
        tail = self._err.read()[-600:].decode(errors="replace").strip()
        self._out.close()
        self._err.close()
        if code != 0:
            return f"exit status {code}: {tail}", None
        last = lines[-1] if lines else "none"  # (the child's last line: what it compiled)
        return None, (None if last == "none" else from_json(last))


def start_at_launch(cfg: JobConfig, train_argv: list[str]) -> WarmUpProcess | None:
    """From `titanrush.train`, once the config is read: the child for this rank's flash-attn-4 kernels,
    where the config runs flash attention at fixed shapes (no pipeline, no context parallel) and FA4's
    disk cache is on; the trainer's warm-up thread then waits for it instead of starting one."""
    global _AT_LAUNCH
    p = cfg.parallelism
    enable_disk_cache()
    if cfg.model.attn_backend != "flash" or p.pp > 1 or p.cp > 1 or not disk_cache_enabled():
        return None
    _AT_LAUNCH = WarmUpProcess(train_argv=train_argv)
    return _AT_LAUNCH


def take_started() -> WarmUpProcess | None:
    """The child started at launch, handed over once (a second trainer in the process starts its own)."""
    global _AT_LAUNCH
    proc, _AT_LAUNCH = _AT_LAUNCH, None
    return proc


def shapes_from_config(train_argv: list[str]) -> FlashShapes | None:
    """This rank's flash shapes from the training arguments, as the trainer works them out; on this
    rank's GPU (LOCAL_RANK), or on the CPU where there is none. None where flash-attn-4 does not run."""
    import torch

    from titanrush import config as cfgmod
    from titanrush.models.llama.attention import flash_kernels
    from titanrush.train import split_args
    from titanrush.trainer import check_config, flash_shapes

    path, _, overrides = split_args(train_argv)
    cfg = cfgmod.load(path, overrides)
    dims, args, _ = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    try:
        if flash_kernels() is None:  # FA3 or FA2: compiled kernels ship with the package
            return None
    except ImportError:
        return None
    return flash_shapes(cfg, dims, args, device)


def main(argv: list[str]) -> int:
    from titanrush.models.llama.attention import warm_up

    shapes = shapes_from_config(argv[1:]) if argv[0] == "--from-config" else from_json(argv[0])
    if shapes is not None:
        warm_up(shapes)
    print(to_json(shapes) if shapes is not None else "none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
