"""Fixtures of the parallel tests; the helpers live in harness.py (importable from the test modules)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import run_train  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[dict]]:
    """Single-process runs, cached per set of overrides for the whole session."""
    cache: dict[tuple[str, ...], list[dict]] = {}
    dump = tmp_path_factory.mktemp("reference")

    def get(*overrides: str) -> list[dict]:
        if overrides not in cache:
            cache[overrides] = run_train(dump, f"ref{len(cache)}", 1, *overrides)
        return cache[overrides]

    return get
