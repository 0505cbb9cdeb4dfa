"""flash-attn-4's kernels compiled in a process of their own, beside a run's start-up.

FA4 compiles each kernel at its first call: seconds of Python (the CuTe DSL builds its IR) that, on a
thread of the training process, hold the interpreter that the set-up needs (the 8B's set-up took 10-13 s
instead of 5 with the compile on a thread beside it). A child process compiles them at the training's
shapes instead and writes them to FA4's disk cache, from which the training process loads them at its
first call. `titanrush.train` starts such a child right after reading the config, before its own imports
of torch and the trainer, so that the child's start-up runs beside the parent's (`python -m
titanrush.train --flash-warm-up ARGS`: the child works its shapes out of the same arguments), and passes
it to the trainer, whose warm-up thread waits for it (or starts one at its own shapes:
`python -m titanrush.models.flash_warm_up '<shapes as JSON>'`). This module imports no torch at import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from titanrush.models.llama.attention import FlashShapes

MARK = "titanrush flash-attn-4 shapes: "  # the child's report line, then the shapes as JSON or `none`
TIMEOUT_S = 300.0  # a child still compiling after this is stopped; step 1 then compiles


def enable_disk_cache() -> None:
    """FA4's disk cache of compiled kernels (read by FA4 when imported), on unless the environment says
    otherwise, as inductor's cache is: later runs load them, and a child's kernels reach the parent."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")


def disk_cache_enabled() -> bool:
    return os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1"


def rank_shapes(
    args: Any, *, device: torch.device, batch: int, seq_len: int, tp: int, pp: int, cp: int, in_graph: bool
) -> FlashShapes | None:
    """One rank's attention inputs in training (`args`: the model's arguments): the local batch and
    sequence, the heads that tensor parallel leaves it; None where they vary (a pipeline's micro-batches,
    context parallel's shards)."""
    from titanrush.models.llama.attention import FlashShapes

    if pp > 1 or cp > 1:
        return None
    return FlashShapes(
        device=device, batch=batch, seq_len=seq_len, n_heads=args.n_heads // tp,
        n_kv_heads=args.kv_heads // tp, head_dim=args.head_dim, in_graph=in_graph,
    )  # fmt: skip


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


def warm_up_and_report(shapes: FlashShapes | None) -> int:
    """A child's work: the warm-up at `shapes` (none to do where None), then the report line."""
    from titanrush.models.llama.attention import warm_up

    if shapes is not None:
        warm_up(shapes)
    print(MARK + (to_json(shapes) if shapes is not None else "none"), flush=True)
    return 0


class WarmUpProcess:
    """A child `python -m MODULE ARGS...` that compiles the kernels and reports the shapes it compiled.
    `wait()` gives (None, those shapes or None) once it succeeded, else (why it failed: its exit status
    and the end of its stderr, or its time limit; None). `env`: the environment to start it with (a
    copy taken on the caller's thread)."""

    def __init__(self, module: str, args: list[str], env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        package_root = str(Path(__file__).resolve().parents[2])  # titanrush importable wherever we run
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        self._out = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait() or kill()
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait() or kill()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=env, stdout=self._out, stderr=self._err
        )

    @classmethod
    def at(cls, shapes: FlashShapes, env: dict[str, str] | None = None) -> WarmUpProcess:
        """The child for these shapes (this module's `main`)."""
        return cls(__name__, [to_json(shapes)], env)

    def wait(self, timeout: float = TIMEOUT_S) -> tuple[str | None, FlashShapes | None]:
        try:
            code = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return f"still running after {timeout:.0f} s, stopped", None
        self._out.seek(0)
        self._err.seek(0)
        reports = [ln for ln in self._out.read().decode(errors="replace").splitlines() if ln.startswith(MARK)]
        tail = self._err.read()[-600:].decode(errors="replace").strip()
        self._close()
        if code != 0 or not reports:
            return f"exit status {code}: {tail}", None
        report = reports[-1].removeprefix(MARK)
        return None, (None if report == "none" else from_json(report))

    def kill(self) -> None:
        """Stop the child where it still runs, and reap it (a child nobody waited for)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._close()

    def _close(self) -> None:
        self._out.close()
        self._err.close()


def main(argv: list[str]) -> int:
    """The child of `WarmUpProcess.at`: the warm-up at the shapes given as JSON."""
    return warm_up_and_report(from_json(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
