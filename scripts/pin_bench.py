"""How long pinning host memory takes, the way activation offload's first step asks for it.

`python scripts/pin_bench.py --gib 12.5 --mode default|register8` times allocating that much pinned host
memory in 448 MiB and 128 MiB tensors (the sizes of an 8B block's largest saved activations) through
PyTorch's caching host allocator, in a fresh process: `default` (cudaHostAlloc) or `register8` (malloc,
pages touched by 8 threads, then cudaHostRegister: `pinned_use_cuda_host_register`). Prints one JSON line.
Run one process per GPU at once to see what four ranks pinning together cost.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from titanrush.trainer import set_allocator

# register threads (the trainer's offload_pin_threads); 0: cudaHostAlloc
MODES = {"default": 0, "register8": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=12.5)
    ap.add_argument("--mode", choices=sorted(MODES), default="default")
    a = ap.parse_args()
    if MODES[a.mode]:
        set_allocator(expandable=True, pin_threads=MODES[a.mode])
    torch.cuda.init()
    sizes, total = [], 0
    while total < a.gib * 2**30:  # the pattern of one block: 448, 128, 128, 448, 128 MiB ...
        size = (448 if len(sizes) % 3 == 0 else 128) * 2**20
        sizes.append(size)
        total += size
    t0 = time.perf_counter()
    kept = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in sizes]
    seconds = time.perf_counter() - t0
    assert all(t.is_pinned() for t in kept)
    print(
        json.dumps(
            {"mode": a.mode, "gib": total / 2**30, "tensors": len(sizes), "seconds": round(seconds, 2)}
        )
    )


if __name__ == "__main__":
    main()
