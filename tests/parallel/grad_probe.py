"""Per-parameter gradient parity of parallelize_llama against one process, for several meshes in one job.

Run under torchrun (gloo, CPU): `torchrun --nproc_per_node=4 tests/parallel/grad_probe.py OUT.json`.
For each mesh, every rank builds the debug Llama on the meta device, parallelizes it, initializes it
(the same weights whatever the mesh), runs forward and backward on its data-parallel share of one fixed
global batch, and all-gathers every gradient to its full shape. Rank 0 compares each with the gradient
of the unsharded model on the whole batch and writes, per mesh, the largest deviation relative to the
gradient's largest entry, plus the two losses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanrush import config
from titanrush.distributed import destroy
from titanrush.models.init import _canonical
from titanrush.models.llama import Llama
from titanrush.models.llama.loss import cross_entropy, valid_tokens, vocab_parallel_cross_entropy_sum
from titanrush.models.llama.parallelize import parallelize_llama
from titanrush.run.plan import RunPlan, build_plan

P = "--parallelism."
# name -> config overrides, for a world of 4.
MESHES: dict[str, list[str]] = {
    "fsdp4": [],
    "ddp4": [P + "dp_replicate", "4", P + "dp_shard", "1"],
    "tp4": [P + "tp", "4"],
    "tp2_no_sp_no_lp": [
        P + "tp",
        "2",
        "--no-parallelism.sequence_parallel",
        "--no-parallelism.loss_parallel",
    ],
    "fsdp2_tp2": [P + "tp", "2"],
    "hsdp2x2": [P + "dp_replicate", "2", P + "dp_shard", "2"],
    "fsdp2_tp2_ac_op": [P + "tp", "2", "--activation_checkpoint.mode", "selective"],
    "fsdp2_tp2_tied": [P + "tp", "2", "--model.tie_embeddings", "tied"],
    # the chunked loss (gradients computed in forward, uneven chunks) under FSDP against the plain loss
    "fsdp4_chunked": ["--training.loss", "chunked", "--training.loss_chunk_size", "24"],
}
BATCH, SEQ = 4, 32
BASE = ["--training.local_batch_size", "1", "--training.seq_len", str(SEQ)]


def grads_of(model: torch.nn.Module, mesh: Any, plan: RunPlan) -> tuple[float, dict]:
    """Forward and backward on this rank's share of the batch; (global mean loss, full gradients)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (BATCH, SEQ + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if mesh is not None and plan.dp > 1:
        n, r = BATCH // plan.dp, mesh["dp"].get_local_rank()
        x, y = x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]
    if model.args.loss_chunk_size:
        loss = model(x, labels=y)
    elif plan.vocab_parallel_loss:  # the trainer's loss under loss parallel, as a mean
        loss = vocab_parallel_cross_entropy_sum(model(x), y) / valid_tokens(y)
    else:
        loss = cross_entropy(model(x), y)
    loss.backward()
    loss = loss.detach()
    if mesh is not None and plan.dp > 1:
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        loss = loss / plan.dp
    grads = {}
    for name, param in model.named_parameters():
        g = param.grad
        grads[_canonical(name)] = g.full_tensor() if isinstance(g, DTensor) else g
    return loss.item(), grads


def plan_of(world: int, over: list[str]) -> RunPlan:
    """The run plan of the debug model's first two layers with these overrides on `world` ranks."""
    plan = build_plan(config.load(None, [*BASE, *over]), world)
    return dataclasses.replace(plan, args=dataclasses.replace(plan.args, n_layers=2))


def build(plan: RunPlan, mesh: Any) -> nn.Module:
    with torch.device("meta"):
        model = Llama(plan.args)
    parallelize_llama(model, mesh, plan.parallelize_plan)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    return model


def vocab_parallel_loss_deviations(world: int) -> dict[str, dict[str, Any]]:
    """The loss parallel's function against F.cross_entropy on the whole logits: a vocabulary of 67 over
    `world` ranks (uneven shards), ignored labels, rows in chunks of 2; fp32 and bf16 logits (the
    reference takes the bf16 values in fp32). Deviations relative to the reference's largest value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titanrush.models.llama import loss as loss_module

    mesh, out = init_device_mesh("cpu", (world,)), {}
    loss_module.LOSS_CHUNK_ELEMENTS = 40  # (2 rows of 17 per chunk)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(3, 5, 67, generator=gen) * 4
    labels = torch.randint(0, 67, (3, 5), generator=gen)
    labels[0, :2] = labels[2, 4] = -100
    for dtype in (torch.float32, torch.bfloat16):
        x = distribute_tensor(full.to(dtype).clone(), mesh, [Shard(2)]).requires_grad_()
        loss = vocab_parallel_cross_entropy_sum(x, labels)
        (loss * 0.5).backward()
        ref_x = full.to(dtype).float().clone().requires_grad_()
        ref = F.cross_entropy(ref_x.flatten(0, 1), labels.flatten(0, 1), reduction="sum")
        (ref * 0.5).backward()
        grad = x.grad.full_tensor().float()
        out[f"vocab_parallel_loss_{str(dtype)[6:]}"] = {
            "loss_dev": abs(loss.item() - ref.item()) / ref.item(),
            "grad_dev": ((grad - ref_x.grad).abs().max() / ref_x.grad.abs().max()).item(),
            "ignored_rows_grad": grad.flatten(0, 1)[labels.flatten() == -100].abs().max().item(),
        }
    loss_module.LOSS_CHUNK_ELEMENTS = 2**26
    return out


def main(out_path: str) -> None:
    torch.use_deterministic_algorithms(True)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, dict[str, Any]] = {}
    for name, over in MESHES.items():
        plan = plan_of(world, over)
        mesh = plan.dims.build_mesh("cpu")
        loss, grads = grads_of(build(plan, mesh), mesh, plan)
        if rank == 0:  # the reference: one process, the plain loss, the same model (tied or not)
            tied = [a for a in over if a in ("--model.tie_embeddings", "tied")]
            one = plan_of(1, tied)
            ref_loss, ref = grads_of(build(one, None), None, one)
            assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
            dev = {k: ((grads[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}
            worst = max(dev, key=dev.get)
            report[name] = {"loss": loss, "ref_loss": ref_loss, "max_grad_dev": dev[worst], "worst": worst}
        dist.barrier()
    report |= vocab_parallel_loss_deviations(world)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1])
