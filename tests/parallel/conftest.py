"""Fixtures of the parallel tests; the helpers live in harness.py (importable from the test modules)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import Reference  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Single-process runs, cached per set of overrides for the whole session: `reference(*overrides)`."""
    return Reference(tmp_path_factory.mktemp("reference"))
