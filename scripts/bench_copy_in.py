"""FSDP's reduce-scatter copy-in at the 8B's unit shapes: its `chunk_cat` against plain copies.

Before each reduce-scatter FSDP copies a unit's unsharded bf16 gradients into one fp32 buffer laid out
rank by rank (`torch._chunk_cat`, casting as it copies). The 8B float8 profile spends 27 ms per step
there, 34 calls moving 1.3 GB each at about 1.7 TB/s. This times the candidates on one GPU and checks
that each writes exactly what chunk_cat writes:

    PYTHONPATH=. python scripts/bench_copy_in.py [--world 4] [--iters 50]

Methods: FSDP's chunk_cat; one copy per rank's chunk of each gradient; one strided copy per gradient;
one foreach copy over all chunks (titanrush's `reduce_scatter_copy_in`).
"""

from __future__ import annotations

import argparse

import torch

# One 8B block's parameters in FSDP's order (attention, feed-forward, the two norms), and the head.
DIM, KV, FFN, VOCAB = 4096, 1024, 14336, 128256
BLOCK = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (FFN, DIM), (DIM, FFN), (FFN, DIM), (DIM,), (DIM,)]
HEAD = [(DIM,), (VOCAB, DIM)]


def copy_in_chunk_cat(grads: list[torch.Tensor], out: torch.Tensor, world: int) -> None:
    torch._chunk_cat(grads, 0, world, out=out.view(world, -1))


def copy_in_per_chunk(grads: list[torch.Tensor], out: torch.Tensor, world: int) -> None:
    rows, col = out.view(world, -1), 0
    for g in grads:
        m = g.numel() // world
        for r, chunk in enumerate(g.view(world, m)):
            rows[r, col : col + m].copy_(chunk)
        col += m


def copy_in_strided(grads: list[torch.Tensor], out: torch.Tensor, world: int) -> None:
    rows, col = out.view(world, -1), 0
    for g in grads:
        m = g.numel() // world
        rows[:, col : col + m].copy_(g.view(world, m))
        col += m


def copy_in_foreach(grads: list[torch.Tensor], out: torch.Tensor, world: int) -> None:
    from titanrush.parallel.fsdp import reduce_scatter_copy_in  # titanrush's: one foreach copy

    reduce_scatter_copy_in(grads, out, world)


METHODS = {
    "chunk_cat": copy_in_chunk_cat,
    "per_chunk": copy_in_per_chunk,
    "strided": copy_in_strided,
    "foreach": copy_in_foreach,
}


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, world {a.world}")
    print("| unit | grads -> buffer | MB moved | " + " | ".join(f"{m} ms (TB/s)" for m in METHODS) + " |")
    print("|---|---|---:|" + "---:|" * len(METHODS))
    for unit, shapes in (("block", BLOCK), ("head", HEAD)):
        for gd, rd in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
            grads = [torch.randn(s, device=dev, dtype=gd) for s in shapes]
            n = sum(g.numel() for g in grads)
            moved = n * (grads[0].element_size() + torch.empty((), dtype=rd).element_size())
            ref = torch.empty(n, device=dev, dtype=rd)
            copy_in_chunk_cat(grads, ref, a.world)
            cells = []
            for fn in METHODS.values():
                out = torch.full((n,), float("nan"), device=dev, dtype=rd)
                fn(grads, out, a.world)
                if not torch.equal(out, ref):
                    cells.append("WRONG")
                    continue
                ms = time_ms(lambda fn=fn, out=out, g=grads: fn(g, out, a.world), a.iters)
                cells.append(f"{ms:.3f} ({moved / ms / 1e9:.2f})")
            kind = f"{str(gd)[6:]} -> {str(rd)[6:]}"
            print(f"| {unit} | {kind} | {moved / 1e6:,.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
