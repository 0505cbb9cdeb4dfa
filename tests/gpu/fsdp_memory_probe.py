"""FSDP's memory on NCCL with and without titanrush's two changes to it (2 GPUs).

Run under torchrun: `torchrun --nproc_per_node=2 tests/gpu/fsdp_memory_probe.py OUT.json FREE POOL`, FREE
and POOL true or false: `parallelism.fsdp_free_reduce_inputs` and `fsdp_grads_in_compute_pool`.
Builds the debug Llama with a large untied vocabulary (so the output layer's fp32 reduce-scatter input,
4 x 131072 x 256 bytes = 128 MiB, dwarfs the blocks'), shards it over the 2 GPUs in bf16 with the
chunked loss, and runs three training steps (AdamW, gradients set to None after each step). A hook
registered after FSDP's on the last block's output records the memory allocated once the GPU has caught
up, as that block's backward starts. Rank 0 writes that figure (the last step's), the peak reserved
memory, the count of released inputs, the losses, the gradients' norm before the last step, the bytes
of the sharded gradients by the allocator pool that holds them (the compute stream's or another's)
and the reserved bytes by pool at the end.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanrush.config import ActivationCheckpoint, Compile, Float8, Parallelism
from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.parallelize import parallelize_llama
from titanrush.parallel.parallel_dims import ParallelDims

VOCAB, BATCH, SEQ = 131072, 2, 1024


def main(out_path: str, free: bool, pool: bool) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", rank)
    p = Parallelism(fsdp_free_reduce_inputs=free, fsdp_grads_in_compute_pool=pool)
    dims = ParallelDims(1, world, 1, 1, 1, world)
    mesh = dims.build_mesh("cuda")
    with torch.device("meta"):
        model = Llama(model_args("debug", vocab_size=VOCAB, tie_embeddings=False, loss_chunk_size=512))
    parallelize_llama(
        model, dims, mesh, parallelism=p, compile=Compile(), ac=ActivationCheckpoint(mode="none"),
        float8=Float8(), precision="bf16", device=device,
    )  # fmt: skip
    model.to_empty(device=device)
    model.init_weights(seed=7)
    at_start: list[int] = []

    def probe(grad: torch.Tensor) -> None:
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # an allocation: the allocator retires what the streams finished
        at_start.append(torch.cuda.memory_allocated())

    def on_output(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(probe)  # after FSDP's and the release's hooks on the same tensor

    list(model.layers.values())[-1].register_forward_hook(on_output)
    gen = torch.Generator().manual_seed(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        norm = torch.stack([
            (g.full_tensor() if isinstance(g, DTensor) else g).float().norm() for g in
            (q.grad for q in model.parameters())
        ]).norm().item()  # fmt: skip
        grad_streams = _grad_bytes_by_pool(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    reserved = _reserved_by_pool()
    if rank == 0:
        report = {
            "free": free, "allocated_at_last_block_backward": at_start[-1], "losses": losses,
            "grad_norm": norm, "released": getattr(model, "fsdp_released_reduce_inputs", None),
            "max_reserved": torch.cuda.max_memory_reserved(), "torch": torch.__version__,
            "rs_calls": getattr(getattr(model, "fsdp_reduce_scatter", None), "calls", None),
            "grad_bytes": grad_streams, "reserved": reserved,
        }  # fmt: skip
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def _pool(stream: int) -> str:
    return "compute" if stream == torch.cuda.current_stream().cuda_stream else "other"


def _grad_bytes_by_pool(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the rank's sharded gradients by the pool (stream) of the segment that holds them."""
    segments = [(s["address"], s["address"] + s["total_size"], _pool(s["stream"])) for s in
                torch.cuda.memory_snapshot()]  # fmt: skip
    out = {"compute": 0, "other": 0}
    for q in model.parameters():
        g = q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad
        where = [pool for lo, hi, pool in segments if lo <= g.data_ptr() < hi]
        assert len(where) == 1, (g.data_ptr(), where)
        out[where[0]] += g.numel() * g.element_size()
    return out


def _reserved_by_pool() -> dict[str, int]:
    """Reserved bytes by pool: the compute stream's and the others' (the collectives' streams)."""
    out = {"compute": 0, "other": 0}
    for s in torch.cuda.memory_snapshot():
        out[_pool(s["stream"])] += s["total_size"]
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "true", sys.argv[3] == "true")
