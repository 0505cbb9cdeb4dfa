"""torchtitan 0.2.2's trainer on the CPU, for the parity mode's CPU check (side_by_side.py --parity on a
machine without a GPU): `python -m torch.distributed.run ... tt_cpu.py --job.config_file FILE`.

torchtitan 0.2.2 trains on an accelerator: it takes "cuda" where none is found, imports triton for its MoE
kernels, and counts experts' tokens with an integer histogram that only CUDA implements. Here, before its
trainer is imported: the device is "cpu" with a stand-in for the CUDA calls it makes (device name and
properties, memory statistics, set_device, synchronize), the triton kernels module is left out (only
expert parallel uses it), and `torch.histc` of integers counts through float32 (exact below 2**24). The
run's config turns compile and bf16 off. What it computes is torchtitan's own code otherwise.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch


def no_triton_kernels() -> types.ModuleType:
    """A stand-in for torchtitan.models.moe.kernels (triton; expert parallel only), put in sys.modules."""
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = None
    sys.modules[kernels.__name__] = kernels
    return kernels


_histc = torch.histc


def _histc_any(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if x.is_floating_point():
        return _histc(x, *args, **kwargs)
    return _histc(x.float(), *args, **kwargs).to(x.dtype)


class _Properties:
    total_memory = 2**40


class CpuDevice:
    """torch.cpu, with the CUDA calls torchtitan makes answered for the host."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, *_: Any) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, *_: Any) -> _Properties:
        return _Properties()

    def memory_stats(self, *_: Any) -> dict[str, int]:
        keys = ("active_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries", "num_ooms")
        return dict.fromkeys(keys, 0)

    def set_device(self, *_: Any) -> None: ...

    def synchronize(self, *_: Any) -> None: ...

    def reset_peak_memory_stats(self, *_: Any) -> None: ...

    def empty_cache(self) -> None: ...


def main() -> None:
    no_triton_kernels()
    torch.histc = _histc_any
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", CpuDevice()
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils

    parallel_dims.device_type = dist_utils.device_type = metrics.device_type = "cpu"
    dist_utils.device_module = metrics.device_module = utils.device_module
    from torchtitan.train import Trainer
    from torchtitan.train import main as train

    train(Trainer)


if __name__ == "__main__":
    main()
