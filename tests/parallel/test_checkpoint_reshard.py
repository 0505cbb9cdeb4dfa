"""A checkpoint saved under one mesh resumes under another, data position included.

FSDP2 (2 ranks) saves at step 3 of 6; the run then resumes from that checkpoint as one process, as TP2 and
as PP2, each time with the same global batch: the resumed run must train on the batches the original
would have seen next, so its losses at steps 4-6 match the uninterrupted FSDP2 run's (to the parity
suite's tolerance: the meshes differ only in the order of floating-point sums).
"""

from __future__ import annotations

import pytest
from harness import STEPS, launch
from test_parity import RTOL

pytestmark = pytest.mark.parallel


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    dump = tmp_path_factory.mktemp("reshard")
    rows = launch(dump, "fsdp2", 2, "--checkpoint.enable", "--checkpoint.interval", "3", dp=2)
    saves = {r["step"]: r for r in rows if "ckpt_save_s" in r}  # the checkpoints' timings: rows of their own
    assert sorted(saves) == [3, 6]
    assert all(0 < r["ckpt_blocking_s"] <= r["ckpt_save_s"] for r in saves.values())
    train = {r["step"]: r for r in rows if "loss" in r}
    assert list(train) == list(range(1, STEPS + 1))
    return dump, train


TARGETS = {
    "one_process": (1, 1, []),
    "tp2": (2, 1, ["--parallelism.tp", "2"]),
    "pp2": (2, 1, ["--parallelism.pp", "2"]),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_fsdp2_checkpoint_resumes_on_another_mesh(saved, target):
    dump, ref = saved
    nproc, dp, overrides = TARGETS[target]
    ckpt = dump / "fsdp2" / "checkpoint" / "step-3"
    rows = launch(dump, f"resume_{target}", nproc, "--checkpoint.load_path", str(ckpt), *overrides, dp=dp)
    load, rows = rows[0], rows[1:]
    assert load["step"] == 3 and load["ckpt_load_s"] > 0  # the load time, resharding included
    assert [r["step"] for r in rows] == list(range(4, STEPS + 1))  # continued at step 4
    for r in rows:
        for key in ("loss", "grad_norm"):
            assert abs(r[key] - ref[r["step"]][key]) <= RTOL * abs(ref[r["step"]][key]), (target, r, key)
