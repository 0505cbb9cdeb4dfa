"""The host link's bandwidth, alone and beside compute: what activation offload can move per second.

Copies CHUNK-sized tensors between the GPU and pinned host memory on a side stream (as the offload does)
and times them alone, then beside a loop of bf16 matmuls on the compute stream, whose slowdown it also
prints. Usage: python scripts/host_link.py [--gib 8] [--chunk-mib 256]
"""

from __future__ import annotations

import argparse
import time

import torch


def copies(src: list[torch.Tensor], dst: list[torch.Tensor], stream: torch.cuda.Stream) -> torch.cuda.Event:
    with torch.cuda.stream(stream):
        for s, d in zip(src, dst):
            d.copy_(s, non_blocking=True)
        return stream.record_event()


def matmuls(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a @ a


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--chunk-mib", type=int, default=256)
    a = ap.parse_args()
    n = int(a.gib * 1024 / a.chunk_mib)
    numel = a.chunk_mib << 19  # bf16 elements
    gpu = [torch.empty(numel, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    host = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=True) for _ in range(n)]
    side = torch.cuda.Stream()
    gb = n * numel * 2 / 1e9
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):  # warm-up
        copies(gpu, host, side).synchronize()
        matmuls(x, 5)
    d2h = gb / timed(lambda: copies(gpu, host, side).synchronize())
    h2d = gb / timed(lambda: copies(host, gpu, side).synchronize())
    per_mm = timed(lambda: matmuls(x, 20)) / 20
    reps = max(20, round(gb / min(d2h, h2d) / per_mm))  # matmuls lasting about as long as the copies
    alone = timed(lambda: matmuls(x, reps))
    tflops = 2 * 8192**3 * reps / alone / 1e12
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, {gb:.1f} GB in {a.chunk_mib} MiB chunks")
    print(f"pinned copies alone: device->host {d2h:.1f} GB/s, host->device {h2d:.1f} GB/s")
    print(f"bf16 matmuls (8192^3) alone: {alone * 1e3:.0f} ms for {reps} ({tflops:.0f} TFLOP/s)")
    for way, src, dst in (("device->host", gpu, host), ("host->device", host, gpu)):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        mm_end = torch.cuda.Event(enable_timing=True)
        copy_end = torch.cuda.Event(enable_timing=True)
        start.record()
        side.wait_event(start)
        with torch.cuda.stream(side):
            for s_, d_ in zip(src, dst):
                d_.copy_(s_, non_blocking=True)
            copy_end.record()
        matmuls(x, reps)
        mm_end.record()
        torch.cuda.synchronize()
        mm_s, copy_s = start.elapsed_time(mm_end) / 1e3, start.elapsed_time(copy_end) / 1e3
        print(
            f"beside each other, {way}: copies {gb / copy_s:.1f} GB/s, matmuls {mm_s * 1e3:.0f} ms "
            f"({mm_s / alone:.3f}x alone)"
        )


if __name__ == "__main__":
    main()
