"""One rank of tests/parallel/test_group_timeout.py: `python group_timeout_probe.py VIEW SLEEPER TIMEOUT`.

Four gloo ranks build the trainer's mesh (dp_shard 2 x tp 2) with the collective timeout TIMEOUT (the
default group's start-up with a minute, so that a slow start is no failure), then all-reduce over the
mesh view VIEW; rank SLEEPER never enters it. A rank whose all-reduce fails prints how
long it waited and exits with 3; a rank whose all-reduce completes prints `done`.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from titanrush import distributed
from titanrush.parallel.parallel_dims import ParallelDims


def main(view: str, sleeper: int, timeout: float) -> None:
    distributed.init(torch.device("cpu"), timeout_s=60.0)
    dist.barrier()  # (every rank here: the mesh's groups start together)
    mesh = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4).build_mesh("cpu", timeout)
    group = mesh[view].get_group()
    if dist.get_rank() == sleeper:
        time.sleep(120)  # (the launcher stops this rank once a peer has failed)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError:
        print(f"rank {dist.get_rank()} failed after {time.monotonic() - start:.1f} s", flush=True)
        sys.exit(3)
    print(f"rank {dist.get_rank()} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
