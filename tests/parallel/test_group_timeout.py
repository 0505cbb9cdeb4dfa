"""job.collective_timeout reaches the mesh's groups under gloo, not only the default group (issue #48): a
collective of a mesh dimension, or of a flattened view, that one rank never enters fails on its peers
after the configured timeout instead of torch's 30 minutes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness import spawn

PROBE = str(Path(__file__).with_name("group_timeout_probe.py"))
TIMEOUT = 8.0


@pytest.mark.parallel
@pytest.mark.parametrize("view, sleeper, peer", [("tp", 1, 0), ("dp_cp", 2, 0)])
def test_a_collective_nobody_joins_fails_after_the_configured_timeout(view, sleeper, peer):
    result = spawn([PROBE, view, str(sleeper), str(TIMEOUT)], nproc=4, timeout=90)
    assert result.returncode == 3, result.stdout[-3000:]
    waited = re.search(rf"rank {peer} failed after ([\d.]+) s", result.stdout)
    assert waited, result.stdout[-3000:]
    assert TIMEOUT - 0.5 <= float(waited.group(1)) < 60, result.stdout[-3000:]  # not torch's 1800 s
