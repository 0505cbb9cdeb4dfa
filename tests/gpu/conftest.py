"""GPU tests: run on the GPU machine (`pytest tests/gpu`); skipped with the reason elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # This hook sees the whole session's items: touch only the ones under tests/gpu.
    for item in items:
        if HERE not in item.path.parents:
            continue
        item.add_marker(pytest.mark.gpu)
        multi = item.get_closest_marker("multigpu")
        need = multi.args[0] if multi is not None and multi.args else 2  # multigpu(n): at least n GPUs
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the GPU machine)"))
        elif multi is not None and torch.cuda.device_count() < need:
            reason = f"needs {need} CUDA GPUs, {torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)"
            item.add_marker(pytest.mark.skip(reason=reason))
