"""A checkpoint saved under one mesh resumes under another, data position included.

FSDP2 (2 ranks) saves at step 3 of 6; the run then resumes from that checkpoint as one process, as TP2 and
as PP2, each time with the same global batch: the resumed run must train on the batches the original
would have seen next, so its losses at steps 4-6 match the uninterrupted FSDP2 run's (to the parity
suite's tolerance: the meshes differ only in the order of floating-point sums).

The runs of 2 processes share one launch (`harness.Cases`): the save first, then the resumes.
"""

from __future__ import annotations

import pytest
from harness import STEPS, Cases
from test_parity import RTOL

pytestmark = pytest.mark.parallel


TARGETS = {
    "one_process": (1, 1, []),
    "tp2": (2, 1, ["--parallelism.tp", "2"]),
    "pp2": (2, 1, ["--parallelism.pp", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Cases:
    cases = Cases(tmp_path_factory.mktemp("reshard"))
    cases.add("fsdp2", 2, "--checkpoint.enable", "--checkpoint.interval", "3", dp=2)
    ckpt = str(cases.dump / "fsdp2" / "checkpoint" / "step-3")
    for target, (nproc, dp, overrides) in TARGETS.items():
        load = ("--checkpoint.load_path", ckpt)
        cases.add(f"resume_{target}", nproc, *load, *overrides, dp=dp, needs=["fsdp2"])
    return cases


@pytest.fixture(scope="module")
def saved(runs):
    rows = runs.rows("fsdp2")
    saves = {r["step"]: r for r in rows if "ckpt_save_s" in r}  # the checkpoints' timings: rows of their own
    assert sorted(saves) == [3, 6]
    assert all(0 < r["ckpt_blocking_s"] <= r["ckpt_save_s"] for r in saves.values())
    train = {r["step"]: r for r in rows if "loss" in r}
    assert list(train) == list(range(1, STEPS + 1))
    return train


@pytest.mark.parametrize("target", list(TARGETS))
def test_fsdp2_checkpoint_resumes_on_another_mesh(runs, saved, target):
    ref = saved  # the uninterrupted run's rows by step
    rows = runs.rows(f"resume_{target}")
    load, rows = rows[0], rows[1:]
    assert load["step"] == 3 and load["ckpt_load_s"] > 0  # the load time, resharding included
    assert [r["step"] for r in rows] == list(range(4, STEPS + 1))  # continued at step 4
    for r in rows:
        for key in ("loss", "grad_norm"):
            assert abs(r[key] - ref[r["step"]][key]) <= RTOL * abs(ref[r["step"]][key]), (target, r, key)
