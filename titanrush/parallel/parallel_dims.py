"""Parallel degrees and the one DeviceMesh with named dimensions.

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. TP is innermost so that its
frequent collectives stay on the fastest links (within a node); PP is outermost since it only sends
activations between neighbours.

Expert parallel borrows its ranks from dp_shard: with ep > 1, dp_shard is built as two dimensions,
`efsdp` (dp_shard / ep, outer) and `ep` (inner, so that the all-to-all stays on the nearest ranks), and
`dp_shard` is their flattened view, so every other part sees the same mesh as without EP. The experts,
split over `ep`, are sharded by FSDP over `efsdp` (x cp: the flattened `efsdp_cp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# The flattened views and the root dimensions each one spans.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),  # data loading: ranks with different batches
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP's shard dimension
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # loss and gradient-norm reduction
}


class JobMesh:
    """The job's DeviceMesh and the views taken from it, each made once.

    `mesh["tp"]` (a dimension of the root) is the root's slice. The flattened views `mesh["dp"]`,
    `mesh["dp_shard_cp"]`, `mesh["dp_cp"]` and FSDP's 2-D `mesh["dp_replicate", "dp_shard_cp"]` are the
    meshes `ParallelDims.build_mesh` kept when it made them: torch deprecates slicing a flattened
    dimension from the root mesh ("Users need to bookkeep the flattened mesh directly"). Everything else
    (`mesh_dim_names`, `shape`, `size()`, `get_group()`, ...) is the root DeviceMesh's; `root` is the
    DeviceMesh itself, for an API that takes one.
    """

    def __init__(self, root: DeviceMesh, views: dict[str | tuple[str, ...], DeviceMesh]) -> None:
        self.root = root
        self._views = views

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        key = names if isinstance(names, str) else tuple(names)
        if key in self._views:
            return self._views[key]
        return self.root[key]

    def meshes(self) -> list[DeviceMesh]:
        """The root and every view: each process group of the job's mesh is a dimension of one of them."""
        return [self.root, *self._views.values()]

    def __getattr__(self, name: str) -> Any:  # only called for what JobMesh itself does not have
        if name == "root":  # not set yet (copy, pickle): no recursion through self.root
            raise AttributeError(name)
        return getattr(self.root, name)

    def __repr__(self) -> str:
        return f"JobMesh({self.root!r}, views {list(self._views)})"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    # Mixture-of-experts layers under tensor parallel: the tp ranks are data-parallel ranks for them, and
    # the mesh gets the views that span tp (`build_mesh`).
    moe_tp: bool = False

    def __post_init__(self) -> None:
        # `titanrush.run.validate.check_degrees` has checked the degrees against the world size.
        if self.dp_shard == -1:
            self.dp_shard = self.world_size // (self.dp_replicate * self.cp * self.tp * self.pp)
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        assert product == self.world_size, f"degrees {self} do not multiply to the world size"

    # Degrees the rest of the code asks about.
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    def build_mesh(self, device_type: str, timeout_s: float | None = None) -> JobMesh:
        """One mesh over all ranks, with the flattened views that the parts need: `dp` (data loading),
        `dp_shard_cp` (FSDP), `dp_cp` (loss and grad-norm reduction), and HSDP's (`dp_replicate`,
        `dp_shard_cp`).

        `timeout_s` (job.collective_timeout): how long a collective of any of the mesh's groups may wait
        (`set_group_timeouts`); None leaves torch's.

        With `moe_tp` (mixture-of-experts layers under tensor parallel) the tp ranks are data-parallel ranks
        for the MoE layers, so their FSDP views span tp too: `dp_shard_cp_tp` (`efsdp_cp_tp` for the
        experts with ep > 1; with HSDP each joined to `dp_replicate`) and `dp_cp_tp` (the experts' load).

        The views are made here and kept (`JobMesh`). `DeviceMesh._flatten` and `_concatenate` are the
        only ways torch 2.11 and 2.13 offer to make them (FSDP2 itself joins its meshes with
        `_concatenate`); the HSDP views join two existing dimensions, so they add no process group.
        With ep > 1 the root holds `efsdp` and `ep` where `dp_shard` was; `dp_shard` (efsdp x ep) and
        `efsdp_cp` (the experts' FSDP) are views too.
        """
        shard = [("dp_shard", self.dp_shard)]
        if self.ep > 1:  # (check_run has checked that ep divides dp_shard)
            shard = [("efsdp", self.dp_shard // self.ep), ("ep", self.ep)]
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            *shard,
            ("cp", self.cp),
            ("tp", self.tp),
        ]
        names = tuple(n for n, _ in dims)
        root = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        spans = dict(FLATTENED)
        if self.moe_tp and self.tp > 1:
            spans |= {
                "dp_shard_cp_tp": ("dp_shard", "cp", "tp"),
                "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),
            }
            if self.ep > 1:
                spans["efsdp_cp_tp"] = ("efsdp", "cp", "tp")
        if self.ep > 1:  # dp_shard is efsdp x ep: every span over it spans both
            spans = {
                n: tuple(x for d in dims_ for x in (("efsdp", "ep") if d == "dp_shard" else (d,)))
                for n, dims_ in spans.items()
            }
            spans = {"dp_shard": ("efsdp", "ep"), "efsdp_cp": ("efsdp", "cp"), **spans}
        views: dict[str | tuple[str, ...], DeviceMesh] = {
            name: root[span]._flatten(name) for name, span in spans.items()
        }
        for shard in ("dp_shard_cp", "efsdp_cp", "dp_shard_cp_tp", "efsdp_cp_tp"):  # HSDP's 2-D meshes
            if shard in views:
                views[("dp_replicate", shard)] = DeviceMesh._concatenate([root["dp_replicate"], views[shard]])
        mesh = JobMesh(root, views)
        if timeout_s is not None:
            set_group_timeouts(mesh.meshes(), timeout_s)
        return mesh


def set_group_timeouts(meshes: list[DeviceMesh], timeout_s: float) -> None:
    """Give every process group of `meshes` (each dimension's, the flattened views') the timeout
    `timeout_s`, through the public `ProcessGroup.set_timeout`, on gloo and NCCL alike. A mesh's groups
    do not inherit the default group's timeout (`init_process_group`'s): torch gives a new group its
    backend's default (gloo 30 min, NCCL 10 min). NCCL's communicators start at a group's first
    collective, after this."""
    if not dist.is_initialized():
        return
    timeout, done = timedelta(seconds=timeout_s), set()
    for mesh in meshes:
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if group.group_name not in done:
                done.add(group.group_name)
                group.set_timeout(timeout)
