"""`plan.probe` in a job of two gloo processes: both ranks measure the same plans, rank 0's choice reaches
both (the run's config.toml holds it), and the run's losses are those of a two-rank run that names the
chosen plan outright."""

from __future__ import annotations

import pytest
from harness import failure, read_metrics, spawn, train_args

from titanrush import config

pytestmark = pytest.mark.parallel
AUTO = ["--activation_checkpoint.mode", "auto", "--training.loss", "auto"]


def test_two_ranks_probe_the_same_plans_and_run_rank_0s_choice(tmp_path):
    probe = ["--plan.probe", "2", "--plan.probe_steps", "1"]
    res = spawn(["-m", "titanrush.train", *train_args(tmp_path, "probed", 2, *AUTO, *probe)], 2)
    assert res.returncode == 0, failure(res.args, res.stdout)
    rank0 = res.stdout.split("--- rank 1:")[0]
    table = rank0[rank0.index("probe (plan.probe 2)") :].splitlines()
    assert all(row.rstrip()[-1].isdigit() for row in table[2:4]), table[:5]  # (two plans, each measured)
    written = tmp_path / "probed" / "config.toml"
    assert not (tmp_path / ".probed.probe").exists() and '"auto"' not in written.read_text()
    chosen = next(row for row in table[2:4] if " * " in row)
    loss = config.load(str(written)).training.loss
    assert f"{loss} loss" in chosen
    again = ["-m", "titanrush.train", "--config", str(written), "--plan.probe", "0", "--job.name", "plain"]
    res = spawn(again, 2)
    assert res.returncode == 0, failure(res.args, res.stdout)
    losses = [
        [r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("probed", "plain")
    ]
    assert losses[0] == losses[1] and len(losses[0]) > 1
