"""GPU tests: run on the GPU machine (`pytest tests/gpu`); skipped with the reason elsewhere."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the GPU machine)"))
        elif item.get_closest_marker("multigpu") and torch.cuda.device_count() < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))
