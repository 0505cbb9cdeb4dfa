"""flash-attn-4's kernels compiled in a process of their own, beside a run's set-up.

FA4 compiles each kernel at its first call: seconds of Python (the CuTe DSL builds its IR) that, on a
thread of the training process, hold the interpreter that the set-up needs (the 8B's set-up took 10-13 s
instead of 5 with the compile on a thread beside it). A child process compiles them at the training's
shapes instead and writes them to FA4's disk cache, from which the training process loads them at its
first call. Run as `python -m titanrush.models.llama.flash_warm_up '<shapes as JSON>'`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from titanrush.models.llama.attention import FlashShapes, warm_up


def disk_cache_enabled() -> bool:
    """Whether FA4 keeps its compiled kernels on disk (read by FA4 at its import; titanrush turns it on
    unless the environment says otherwise), so that a kernel compiled by another process is loaded."""
    return os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1"


def to_json(shapes: FlashShapes) -> str:
    fields = dataclasses.asdict(shapes)
    fields.update(device=str(shapes.device), dtype=str(shapes.dtype).removeprefix("torch."))
    return json.dumps(fields)


def from_json(text: str) -> FlashShapes:
    fields = json.loads(text)
    fields.update(device=torch.device(fields["device"]), dtype=getattr(torch, fields["dtype"]))
    return FlashShapes(**fields)


class WarmUpProcess:
    """The child process that compiles the kernels at `shapes`; `wait()` gives None once it succeeded,
    else why it failed (its exit status and the end of its stderr)."""

    def __init__(self, shapes: FlashShapes) -> None:
        package_root = str(Path(__file__).resolve().parents[3])  # titanrush importable wherever we run
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, to_json(shapes)],
            env={**os.environ, "PYTHONPATH": path},
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )

    def wait(self) -> str | None:
        code = self._proc.wait()
        self._stderr.seek(0)
        tail = self._stderr.read()[-600:].decode(errors="replace").strip()
        self._stderr.close()
        return None if code == 0 else f"exit status {code}: {tail}"


def main(argv: list[str]) -> int:
    shapes = from_json(argv[0])
    if shapes.device.type == "cuda":
        torch.cuda.set_device(shapes.device)
    warm_up(shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
