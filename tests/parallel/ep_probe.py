"""Expert parallel's exchange under torch.compile, with a rank that receives no rows.

Run under torchrun (gloo, CPU): `torchrun --nproc_per_node=2 tests/parallel/ep_probe.py OUT.json`.
One MoE layer (8 experts, 4 per rank) runs 6 steps compiled and the same 6 steps eagerly. Steps 0-2 route
freely (the compiles: a static graph, then a dynamic one); at step 3 the routing bias sends every row to
rank 1's experts, so rank 0's experts receive none; at step 4 a rigged gate sends them exactly one row.
Writes, per rank, the largest difference of the outputs and the input gradients between the two, the
collectives found in the compiled graphs (a recording backend), how many graphs it was given after step
2 (each one a recompile), and the eager layer against the unsharded one on every rank's rows.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from titanrush.distributed import destroy
from titanrush.models.llama4.moe import MoE
from titanrush.parallel.expert_parallel import apply_ep

STEPS, WARM, NO_ROWS, ONE_ROW = 6, 3, 3, 4
ops: set[str] = set()
graphs: list[int] = []  # the step of every graph the backend was given
step_now = [0]  # the step running


def record(gm: torch.fx.GraphModule, inputs: list) -> object:
    """A backend that keeps the call targets of every graph it is given and runs the graph as traced."""
    ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    graphs.append(step_now[0])
    return gm.forward


def route(moe: MoE, step: int, rank: int, x: torch.Tensor) -> torch.Tensor:
    """Set the routing for `step`; returns the step's input (a new shape every step)."""
    with torch.no_grad():
        if step == NO_ROWS:  # every row to rank 1's experts (4-7)
            moe.expert_bias.copy_(torch.tensor([-1e4] * 4 + [1e4] * 4))
        if step == ONE_ROW:  # expert 0 scores sigmoid(100 x_0), the others 0.5 (+0.2 for 4-7)
            moe.expert_bias.copy_(torch.tensor([0.0] * 4 + [0.2] * 4))
            moe.router.gate.weight.zero_()
            moe.router.gate.weight[0, 0] = 100.0
            x[..., 0] = -1.0  # every token to expert 4 ...
            if rank == 0:
                x[0, 0, 0] = 1.0  # ... but one, to expert 0 on rank 0
    return x


class Layer(nn.Module):
    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) * 2


def layer_weights(sharded: bool, mesh: object) -> MoE:
    torch.manual_seed(0)  # the same weights on both ranks and in every run
    moe = MoE(32, 64, 8, 1)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.05)
    if sharded:
        apply_ep([moe.experts], mesh)
    return moe


def against_one_process(rank: int, mesh: object) -> dict[str, float]:
    """The eager EP layer against the unsharded layer on every rank's rows, over the same steps (the
    padded steps included): the largest differences of the outputs, the input gradients and this rank's
    experts' weight gradients."""
    moe, ref = layer_weights(True, mesh), layer_weights(False, mesh)
    world, local = dist.get_world_size(), 8 // dist.get_world_size()
    diff = {"out": 0.0, "grad": 0.0, "expert_grads": 0.0}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = route(moe, step, rank, torch.randn(2, 8 + step, 32, generator=gen))
        route(ref, step, rank, x)
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)
        x, rows = x.requires_grad_(), torch.cat(everyone).requires_grad_()
        y, y_ref = Layer(moe)(x), Layer(ref)(rows)
        y.square().sum().backward()
        y_ref.square().sum().backward()  # (every rank's loss: the sum of the EP ranks' losses)
        mine = slice(2 * rank, 2 * rank + 2)
        diff["out"] = max(diff["out"], (y - y_ref[mine]).abs().max().item())
        diff["grad"] = max(diff["grad"], (x.grad - rows.grad[mine]).abs().max().item())
        for name in ("w13", "w2"):
            got = getattr(moe.experts, name).grad.to_local()
            want = getattr(ref.experts, name).grad[rank * local : (rank + 1) * local]
            diff["expert_grads"] = max(diff["expert_grads"], (got - want).abs().max().item())
        for p in (*moe.parameters(), *ref.parameters()):
            p.grad = None
    return diff


def run(compiled: bool, rank: int, mesh: object) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """The steps' outputs and input gradients, and the rows rank 0's experts received at each step."""
    moe = layer_weights(True, mesh)
    layer = torch.compile(Layer(moe), backend=record) if compiled else Layer(moe)
    out, rank0_rows = [], []
    for step in range(STEPS):
        step_now[0] = step
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = route(moe, step, rank, torch.randn(2, 8 + step, 32, generator=gen)).requires_grad_()
        before = moe.tokens_per_expert.clone()
        y = layer(x)
        y.square().sum().backward()
        out.append((y.detach(), x.grad))
        routed = moe.tokens_per_expert - before  # this rank's tokens per expert, then every rank's
        dist.all_reduce(routed)
        rank0_rows.append(int(routed[:4].sum()))
    return out, rank0_rows


def main(argv: list[str]) -> None:
    """The probe, writing its report to `argv[0]` (also a case of `cases_probe.py`, whose process group it
    uses)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    (eager, rows), (compiled, compiled_rows) = run(False, rank, mesh), run(True, rank, mesh)
    result = {
        "one_process": against_one_process(rank, mesh),
        "rank0_rows": rows,
        "same_routing": rows == compiled_rows,
        "out": max((a[0] - b[0]).abs().max().item() for a, b in zip(eager, compiled)),
        "grad": max((a[1] - b[1]).abs().max().item() for a, b in zip(eager, compiled)),
        "collectives": sorted(t for t in ops if "c10d" in t or "all_to_all" in t),
        "graphs_seen": len(ops) > 0,
        "graphs_after_warmup": sum(step >= WARM for step in graphs),
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(argv[0], "w") as f:
            json.dump(gathered, f)
    torch.compiler.reset()  # (the compiled graphs hold the layer, its DTensors and through them the mesh)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
