"""Per-parameter gradient parity of parallelize_llama against one process, for several meshes in one job.

Run under torchrun (gloo, CPU): `torchrun --nproc_per_node=4 tests/parallel/grad_probe.py OUT.json`.
For each mesh, every rank builds the debug Llama on the meta device, parallelizes it, initializes it
(the same weights whatever the mesh), runs forward and backward on its data-parallel share of one fixed
global batch, and all-gathers every gradient to its full shape. Rank 0 compares each with the gradient
of the unsharded model on the whole batch and writes, per mesh, the largest deviation relative to the
gradient's largest entry, plus the two losses.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanrush.config import ActivationCheckpoint, Compile, Float8, Parallelism
from titanrush.models.init import _canonical
from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.loss import cross_entropy
from titanrush.models.llama.parallelize import parallelize_llama
from titanrush.parallel.fsdp import COPY_IN_CALLS
from titanrush.parallel.parallel_dims import ParallelDims
from titanrush.parallel.tensor_parallel import loss_parallel_context

# name -> [parallelism] overrides, for a world of 4.
MESHES: dict[str, dict[str, Any]] = {
    "fsdp4": {},
    "ddp4": {"dp_replicate": 4, "dp_shard": 1},
    "tp4": {"tp": 4},
    "tp2_no_sp_no_lp": {"tp": 2, "sequence_parallel": False, "loss_parallel": False},
    "fsdp2_tp2": {"tp": 2},
    "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
    "fsdp2_tp2_ac_op": {"tp": 2, "_ac": "selective"},
    "fsdp2_tp2_tied": {"tp": 2, "_tied": True},
    # the chunked loss (gradients computed in forward, uneven chunks) under FSDP against the plain loss
    "fsdp4_chunked": {"_chunk": 24},
    # FSDP's own timing for releasing the reduce-scatter inputs (the others release them early)
    "fsdp4_late_release": {"fsdp_free_reduce_inputs": False},
    # FSDP's own reduce-scatter (the others run titanrush's compute-pool comm: on CPU its collective
    # with plain buffers)
    "fsdp4_own_reduce_scatter": {"fsdp_grads_in_compute_pool": False, "_chunk": 24},
    # FSDP's own copy-in (chunk_cat; the others copy chunk by chunk)
    "fsdp4_chunk_cat": {"fsdp_copy_in_by_chunks": False},
}
BATCH, SEQ = 4, 32


def grads_of(model: torch.nn.Module, mesh: Any, dims: ParallelDims, p: Parallelism) -> tuple[float, dict]:
    """Forward and backward on this rank's share of the batch; (global mean loss, full gradients)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (BATCH, SEQ + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if mesh is not None and dims.dp > 1:
        n, r = BATCH // dims.dp, mesh["dp"].get_local_rank()
        x, y = x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]
    with loss_parallel_context(mesh, dims, p):
        loss = model(x, labels=y) if model.args.loss_chunk_size else cross_entropy(model(x), y)
        loss.backward()
    loss = loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()
    if mesh is not None and dims.dp > 1:
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        loss = loss / dims.dp
    grads = {}
    for name, param in model.named_parameters():
        g = param.grad
        grads[_canonical(name)] = g.full_tensor() if isinstance(g, DTensor) else g
    return loss.item(), grads


def build(dims: ParallelDims, mesh: Any, p: Parallelism, ac: str, tied: bool, chunk: int = 0) -> nn.Module:
    with torch.device("meta"):
        model = Llama(model_args("debug", n_layers=2, tie_embeddings=tied, loss_chunk_size=chunk))
    parallelize_llama(
        model, dims, mesh, parallelism=p, compile=Compile(), ac=ActivationCheckpoint(mode=ac),
        float8=Float8(), precision="fp32",
    )  # fmt: skip
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    return model


def main(out_path: str) -> None:
    torch.use_deterministic_algorithms(True)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    one = ParallelDims(1, 1, 1, 1, 1, 1)
    report: dict[str, dict[str, Any]] = {}
    for name, over in MESHES.items():
        over = dict(over)
        ac, tied, chunk = over.pop("_ac", "none"), over.pop("_tied", False), over.pop("_chunk", 0)
        p = Parallelism(**over)
        dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, world)
        mesh = dims.build_mesh("cpu")
        model = build(dims, mesh, p, ac, tied, chunk)
        calls_before = dict(COPY_IN_CALLS)
        loss, grads = grads_of(model, mesh, dims, p)
        copy_in = {k: v - calls_before[k] for k, v in COPY_IN_CALLS.items()}
        released = getattr(model, "fsdp_released_reduce_inputs", None)
        rs_calls = getattr(getattr(model, "fsdp_reduce_scatter", None), "calls", None)
        if rank == 0:
            ref_loss, ref = grads_of(build(one, None, Parallelism(), "none", tied), None, one, Parallelism())
            assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
            dev = {k: ((grads[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}
            worst = max(dev, key=dev.get)
            report[name] = {"loss": loss, "ref_loss": ref_loss, "max_grad_dev": dev[worst], "worst": worst,
                            "released": released, "rs_calls": rs_calls, "copy_in": copy_in}  # fmt: skip
        dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()
    gc.collect()  # free the meshes' process groups before interpreter shutdown (gloo may abort there)


if __name__ == "__main__":
    main(sys.argv[1])
