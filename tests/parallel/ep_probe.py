"""Expert parallel's exchange under torch.compile, with a rank that receives no rows.

Run under torchrun (gloo, CPU): `torchrun --nproc_per_node=2 tests/parallel/ep_probe.py OUT.json`.
One MoE layer (8 experts, 4 per rank) runs 6 steps compiled and the same 6 steps eagerly; from step 3 on
the routing bias sends every row to rank 1's experts, so rank 0's experts receive none. Writes, per rank,
the largest difference of the outputs and the input gradients between the two, and the collectives found
in the compiled graphs (a recording backend).
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

STEPS, SKEW_FROM = 6, 3
ops: set[str] = set()


def record(gm: torch.fx.GraphModule, inputs: list) -> object:
    """A backend that keeps the call targets of every graph it is given and runs the graph as traced."""
    ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return gm.forward


class Layer(nn.Module):
    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) * 2


def run(compiled: bool, rank: int, mesh: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)  # the same weights on both ranks and in both runs
    moe = MoE(32, 64, 8, 1)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.05)
    apply_ep([moe.experts], mesh)
    layer = torch.compile(Layer(moe), backend=record) if compiled else Layer(moe)
    out = []
    for step in range(STEPS):
        if step == SKEW_FROM:
            with torch.no_grad():
                moe.expert_bias.copy_(torch.tensor([-1e4] * 4 + [1e4] * 4))
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(2, 8 + step, 32, generator=gen, requires_grad=True)  # (a new shape every step)
        y = layer(x)
        y.square().sum().backward()
        out.append((y.detach(), x.grad))
    return out


def main(argv: list[str]) -> None:
    """The probe, writing its report to `argv[0]` (also a case of `cases_probe.py`, whose process group it
    uses)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    eager, compiled = run(False, rank, mesh), run(True, rank, mesh)
    result = {
        "out": max((a[0] - b[0]).abs().max().item() for a, b in zip(eager, compiled)),
        "grad": max((a[1] - b[1]).abs().max().item() for a, b in zip(eager, compiled)),
        "collectives": sorted(t for t in ops if "c10d" in t or "all_to_all" in t),
        "graphs_seen": len(ops) > 0,
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
