"""One rank of tests/gpu/test_group_timeout_gpu.py: `python group_timeout_gpu_probe.py MODE TIMEOUT`.

`mesh`: two NCCL ranks build the trainer's mesh (dp_shard 2) with the collective timeout TIMEOUT and print
each of its process groups' timeout (read from the group's NCCL options) after an all-reduce on it.
`missed`: a group of both ranks made with torch's default timeout (NCCL's 10 minutes) is given TIMEOUT
through `set_group_timeouts`; rank 1 never enters its all-reduce, and NCCL's watchdog on rank 0 must
time it out after TIMEOUT (it aborts the communicator, then ends the process).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanrush import distributed
from titanrush.parallel.parallel_dims import ParallelDims, set_group_timeouts


def main(mode: str, timeout: float) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    distributed.init(device, timeout_s=120.0)
    if mode == "mesh":
        mesh = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2).build_mesh(
            "cuda", timeout
        )
        for mesh_ in mesh.meshes():
            for dim in range(mesh_.ndim):
                group = mesh_.get_group(dim)
                total = torch.ones(1, device=device)
                dist.all_reduce(total, group=group)
                seconds = group._get_backend(device).options._timeout.total_seconds()  # (a test may read it)
                print(f"rank {rank} group {group.group_name} size {int(total.item())} timeout {seconds}")
        dist.barrier()
        dist.destroy_process_group()
        return
    group = dist.new_group([0, 1])
    set_group_timeouts([DeviceMesh.from_group(group, "cuda")], timeout)
    seconds = group._get_backend(device).options._timeout.total_seconds()
    print(f"rank {rank} group {group.group_name} timeout {seconds}", flush=True)
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm, group=group)  # (the communicator starts, both ranks in)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(300)  # (the test ends this rank once rank 0 has failed)
        return
    print(f"rank 0 waits at {time.monotonic():.1f}", flush=True)
    dist.all_reduce(warm, group=group)
    torch.cuda.synchronize()  # (returns once NCCL's watchdog has aborted the communicator)
    time.sleep(300)  # (the watchdog ends this process after its debug dump)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
