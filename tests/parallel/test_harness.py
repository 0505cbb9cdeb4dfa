"""The parallel tests' launcher (`harness.spawn`): torchrun's environment, a failure stops all; runs folded
into one launch (`harness.Cases`): a failing run names itself, and the runs after it still run."""

from __future__ import annotations

import time

import pytest
from harness import Cases, spawn

pytestmark = pytest.mark.parallel

RANK_1_FAILS = """
import os, sys, time
print("rank", os.environ["RANK"], os.environ["WORLD_SIZE"], flush=True)
time.sleep(2)  # (the others have printed)
sys.exit(3) if os.environ["RANK"] == "1" else time.sleep(60)
"""


def test_a_failing_rank_stops_the_others_and_its_status_is_returned():
    t0 = time.monotonic()
    res = spawn(["-c", RANK_1_FAILS], 3)
    assert res.returncode == 3 and time.monotonic() - t0 < 30  # rank 0 and 2 were killed, not waited for
    assert "--- rank 0:\nrank 0 3\n" in res.stdout and "--- rank 2:\nrank 2 3\n" in res.stdout


def test_a_rank_past_the_timeout_is_killed():
    res = spawn(["-c", "import time; time.sleep(60)"], 2, timeout=1)
    assert res.returncode == -9


def test_a_failing_case_fails_alone_and_the_cases_after_it_run(tmp_path):
    cases = Cases(tmp_path)
    one = ("--training.steps", "1")
    cases.add("first", 1, *one)
    cases.add("bad", 1, *one, "--parallelism.tp", "2")  # (a config error: exit status 2)
    cases.add("after", 1, *one)
    cases.launch(1)
    assert cases.outcome["first"] is None and cases.outcome["after"] is None, cases.outcome
    assert "titanrush.train exited with status 2" in cases.outcome["bad"]
    assert "=== case bad" in cases.outcome["bad"] and "=== case first" not in cases.outcome["bad"]
    assert [r["step"] for r in cases.rows("after")] == [1]
