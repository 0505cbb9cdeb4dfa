"""Parallel degrees, their validation, and the one DeviceMesh with named dimensions.

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. TP is innermost so that its
frequent collectives stay on the fastest links (within a node); PP is outermost since it only sends
activations between neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanrush.config import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._resolve_and_validate()

    def _resolve_and_validate(self) -> None:
        fixed = {"dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp, "pp": self.pp}
        for name, degree in fixed.items():
            if degree < 1:
                raise ConfigError(f"parallelism.{name} must be >= 1, got {degree}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ConfigError(
                    f"parallelism degrees dp_replicate x cp x tp x pp = {others} do not divide the world "
                    f"size "
                    f"{self.world_size}; choose degrees whose product divides {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"parallelism.dp_shard must be -1 or >= 1, got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x cp({self.cp}) "
                f"x tp({self.tp}) "
                f"x pp({self.pp}) = {product}, but the world size is {self.world_size}; set "
                f"parallelism.dp_shard = -1 to take what is left, or change the degrees"
            )

    def check_model(self, *, n_heads: int, n_kv_heads: int, n_layers: int, seq_len: int) -> None:
        """Model-dependent checks, before anything is allocated."""
        if n_heads % self.tp or n_kv_heads % self.tp:
            raise ConfigError(
                f"parallelism.tp = {self.tp} must divide the attention heads ({n_heads}) and KV heads "
                f"({n_kv_heads}); choose tp among {_divisors(_gcd(n_heads, n_kv_heads))}"
            )
        if self.pp > n_layers:
            raise ConfigError(f"parallelism.pp = {self.pp} exceeds the model's {n_layers} layers")
        if self.cp > 1 and seq_len % (2 * self.cp * (self.tp if self.tp > 1 else 1)):
            need = 2 * self.cp * (self.tp if self.tp > 1 else 1)
            raise ConfigError(
                f"training.seq_len = {seq_len} must be divisible by "
                f"2 x cp{' x tp' if self.tp > 1 else ''} = {need} "
                f"(context parallel's load balancing splits each sequence into 2 x cp chunks)"
            )
        if self.tp > 1 and seq_len % self.tp:
            raise ConfigError(
                f"training.seq_len = {seq_len} must be divisible by tp = {self.tp} (sequence parallel)"
            )

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
        `dp` (data loading), `dp_shard_cp` (FSDP), `dp_cp` (loss and grad-norm reduction)."""
        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                ("cp", self.cp), ("tp", self.tp)]  # fmt: skip
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        assert self._mesh is not None, "build_mesh() first"
        return self._mesh


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
