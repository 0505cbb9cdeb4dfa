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

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # `titanrush.validate.check_degrees` has checked the degrees against the world size.
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

    @property
    def non_data_parallel_size(self) -> int:
        """GPUs that together hold one replica and process the same tokens."""
        return self.cp * self.tp * self.pp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One mesh over all ranks, with the flattened views that the parts need:
        `dp` (data loading), `dp_shard_cp` (FSDP), `dp_cp` (loss and grad-norm reduction); with ep > 1,
        `dp_shard` (efsdp x ep) and `efsdp_cp` (the experts' FSDP)."""
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
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        if self.ep > 1:
            mesh["efsdp", "ep"]._flatten("dp_shard")
            mesh["efsdp", "cp"]._flatten("efsdp_cp")
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        assert self._mesh is not None, "build_mesh() first"
        return self._mesh
