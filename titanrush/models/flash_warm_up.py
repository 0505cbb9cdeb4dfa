"""flash-attn-4's kernels compiled in a process of their own, beside a run's start-up.

FA4 compiles each kernel at its first call: seconds of Python (the CuTe DSL builds its IR) that, on a
thread of the training process, hold the interpreter that the set-up needs (the 8B's set-up took 10-13 s
instead of 5 with the compile on a thread beside it). A child process compiles them at the training's
shapes instead and writes them to FA4's disk cache, from which the training process loads them at its
first call. `titanrush.train` starts such a child right after reading the config, before its own imports
of torch and the trainer, so that the child's start-up runs beside the parent's (`titanrush.train
--flash-warm-up`: the child works its shapes out of the same arguments) and hands it over here; the
trainer's warm-up thread takes it (`take_started`) or starts one at its shapes
(`python -m titanrush.models.flash_warm_up '<shapes as JSON>'`).
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
    """A child `python -m MODULE ARGS...` that compiles the kernels and prints, last, the shapes it
    compiled as JSON (or `none`). `wait()` gives (None, those shapes or None) once it succeeded, else (why
    it failed: its exit status and the end of its stderr, None)."""

    def __init__(self, module: str, args: list[str]) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # titanrush importable wherever we run
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        self._out = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait()
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env={**os.environ, "PYTHONPATH": path},
            stdout=self._out,
            stderr=self._err,
        )

    @classmethod
    def at(cls, shapes: FlashShapes) -> WarmUpProcess:
        """The child for these shapes (this module's `main`)."""
        return cls(__name__, [to_json(shapes)])

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


def hand_over(proc: WarmUpProcess) -> None:
    """Keep the child that `titanrush.train` started at launch for the trainer's warm-up thread."""
    global _AT_LAUNCH
    _AT_LAUNCH = proc


def take_started() -> WarmUpProcess | None:
    """The child started at launch, handed over once (a second trainer in the process starts its own)."""
    global _AT_LAUNCH
    proc, _AT_LAUNCH = _AT_LAUNCH, None
    return proc


def main(argv: list[str]) -> int:
    """The child of `WarmUpProcess.at`: the warm-up at the shapes given as JSON."""
    from titanrush.models.llama.attention import warm_up

    shapes = from_json(argv[0])
    warm_up(shapes)
    print(to_json(shapes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
