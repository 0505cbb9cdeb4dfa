"""Plain data parallel (DDP) through the composable `replicate`, for dp_replicate > 1 with dp_shard = 1."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, bucket_cap_mb: int = 100) -> None:
    """Replicate `model` over the 1-D data-parallel `mesh`, in place: gradients are all-reduced (averaged)
    in buckets during backward, overlapping communication with the rest of backward.

    DDP is set up lazily at the first forward, so this may run on the meta device, before `to_empty`
    and `init_weights`; every rank then initializes the same weights and DDP's broadcast from rank 0
    changes nothing.

    Args:
        model: A model whose parameters are plain tensors (DDP does not compose with tensor parallel).
        mesh: The 1-D `dp_replicate` mesh.
        bucket_cap_mb: Gradient bucket size: larger buckets mean fewer, bigger all-reduces.

    """
    assert not any(isinstance(p, DTensor) for p in model.parameters()), "DDP does not compose with TP"
    assert mesh.ndim == 1, f"DDP takes a 1-D data-parallel mesh, got {mesh.ndim} dimensions"
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb)
