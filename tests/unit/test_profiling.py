"""The profiler's step boundaries: a GPU sync only where a recorded window opens or closes."""

from __future__ import annotations

import torch

from titanrush.profiling import Profiler


def test_sync_only_around_the_recorded_window(tmp_path, monkeypatch):
    prof = Profiler(tmp_path, enable=True, freq=4, active=1, memory_snapshot=False, rank=0,
                    all_ranks=False, start_step=0)  # fmt: skip
    synced_after: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synced_after.append(prof.step_num))
    try:
        for _ in range(8):
            torch.ones(4) @ torch.ones(4)  # some work in each step
            prof.step()
    finally:
        prof.close()
    # freq 4, one active step: steps 1-2 wait, 3 warms up, 4 is recorded (and 5-8 again); the sync runs
    # as each of steps 3, 4, 7, 8 ends (step_num is already the finished step's number when it runs).
    assert synced_after == [3, 4, 7, 8]
    assert sorted(p.parent.name for p in (tmp_path / "profile").glob("step-*/rank0.trace.json.gz")) == [
        "step-4",
        "step-8",
    ]
