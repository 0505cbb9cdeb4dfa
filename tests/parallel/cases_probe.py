"""Several runs of the real trainer one after the other in the same processes: one launch, not one per run.

Run as the ranks of one job (`harness.spawn`, or torchrun): `cases_probe.py SPEC.json`. SPEC holds
{"cases": [[name, kind, args], ...], "done": PATH}. A case of kind "train" is `titanrush.train.main(args)`
(the entry point; exit status 0 required), kind "cp" or "ep" `cp_probe.main(args)` or `ep_probe.main(args)`.
After each case every rank has finished it and rank 0 appends its name to PATH, so a launch that fails names
the cases it completed.

Start-up is most of a short parallel run's cost on CPU (importing torch, dynamo, DTensor and DCP: about
5 s per process, on 2 cores shared by up to 4 ranks; interpreter teardown, 1.5 to 3 s more), which is
paid here once per launch instead of once per run. Between cases the default process group stays up (the
trainer's `close` would end it, and a second rendezvous on the same port races the first one's teardown):
each run still builds its own DeviceMesh and groups from it, its own model, optimizer and data, seeded by
its config as in a fresh process; compiled graphs are dropped after each case. The last case ends the group
through `titanrush.distributed.destroy` (left to interpreter shutdown, gloo aborts now and then), and the
process leaves through `os._exit`: nothing is left to tear down.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from titanrush import distributed


def run_case(kind: str, args: list[str]) -> None:
    if kind == "train":
        from titanrush.train import main

        status = main(args)
        assert status == 0, f"titanrush.train exited with status {status}"
    elif kind in ("cp", "ep"):  # cp_probe.py, ep_probe.py
        sys.path.insert(0, str(Path(__file__).parent))
        probe = __import__(f"{kind}_probe")
        probe.main(args)
    else:
        raise ValueError(f"unknown case kind {kind!r}")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank = distributed.ranks_from_env().rank
    end_group = distributed.destroy
    distributed.destroy = lambda: None  # (the trainer's close: the group serves the next case)
    try:
        for name, kind, args in spec["cases"]:
            print(f"=== case {name}", file=sys.stderr, flush=True)
            run_case(kind, args)
            torch.compiler.reset()  # (compiled graphs hold the model, its DTensors and through them the mesh)
            gc.collect()
            if dist.is_initialized():
                dist.barrier()  # every rank finished the case
            if rank == 0:
                with open(spec["done"], "a") as f:
                    f.write(name + "\n")
        end_group()
        return 0
    except BaseException:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    status = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
