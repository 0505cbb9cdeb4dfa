"""Fixtures of the reliability tests (faults reproduced on CPU against the real trainer); the helpers live
in faults.py. `saved` trains one run once per session; each test works on its own copy."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# The reliability tests exercise the CPU paths, also on a machine with a GPU.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, str(Path(__file__).parent))

from faults import CKPT, run_args, train  # noqa: E402


@pytest.fixture(scope="session")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 8 steps cut off after step 4, with full checkpoints at steps 2 and 4 (its run folder)."""
    dump = tmp_path_factory.mktemp("saved")
    train(run_args(dump, "src", 8, *CKPT), stop_at=4)
    return dump / "src"


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    """This test's own copy of `saved`, as tmp_path/src (continue it with run_args(tmp_path, 'src', ...))."""
    shutil.copytree(saved, tmp_path / "src")
    return tmp_path / "src"
