"""What a run on this machine will see: `python -m titanrush.tools.device_probe` prints it as one JSON line.

The tools (sweep, rush) ask a child process, so that CUDA never starts in the tool itself; on a host
without a GPU's device file (`titanrush.launch_env.gpu_device_files`) there is no CUDA to start, and they
ask `device_facts` in their own process instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any


def device_facts(gpus: bool = True) -> dict[str, Any]:
    """GPU name, count, capability, memory, attention kernels, packages; a CPU's when no CUDA is visible,
    or when `gpus` is False (a host without a GPU's device file: CUDA is not even asked)."""
    import torch

    d: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": gpus and torch.cuda.is_available(),
        "host_mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
    }
    if d["cuda"]:
        p = torch.cuda.get_device_properties(0)
        flash = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
        cudnn = torch.backends.cudnn.version() or 0
        d.update(
            name=p.name,
            count=torch.cuda.device_count(),
            capability=[p.major, p.minor],
            mem_gib=p.total_memory / 2**30,
            cuda_version=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            flash_sdp=bool(flash and p.major >= 8),
            cudnn_sdp=bool(torch.backends.cudnn.is_available() and p.major >= 8 and cudnn >= 90000),
        )
    else:  # no GPU memory here (the estimates follow estimate.gpu_memory's rule, not the host's RAM)
        d.update(name="cpu", count=0, capability=None, mem_gib=None, flash_sdp=False, cudnn_sdp=False)
    flash_attn = ("flash_attn", "flash_attn_interface")
    d["flash_attn"] = any(importlib.util.find_spec(m) is not None for m in flash_attn)
    d["torchao"] = importlib.util.find_spec("torchao") is not None
    return d


if __name__ == "__main__":
    print(json.dumps(device_facts()))
