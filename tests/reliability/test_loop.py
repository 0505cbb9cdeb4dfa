"""The training loop's reliability (issue #27) and honest numbers (#30), each case reproduced on CPU with the
debug model: non-finite steps, refused runs, the run folder's lock and attempts, signals and a killed
launcher, step time that counts training only (the loss normalized by the global count of valid tokens:
tests/parallel/test_masked_loss.py).

Runs in-process (`titanrush.train.main`) where the exit status and output can be read there, and as child
processes (one, or two under torchrun with gloo) where signals, launchers or several ranks are the point.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from loop_helpers import (
    Child,
    alive,
    children,
    finite_weights,
    launcher,
    read_rows,
    small_args,
)

from titanrush import config, train
from titanrush.run import run_dir
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer


@pytest.fixture(autouse=True)
def fresh_log_handler() -> None:
    """`train.main` sets up titanrush's log handler once per process, on the stderr of the moment; an
    earlier test's captured stderr is closed by now: the next `main` makes a new one."""
    logging.getLogger("titanrush").handlers.clear()


def in_process(capsys: pytest.CaptureFixture, args: list[str]) -> tuple[int, str]:
    """`titanrush train ARGS` in this process: (exit status, what it printed to stderr)."""
    status = train.main(args)
    return status, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Non-finite steps


def test_a_blown_up_step_stops_the_run_before_any_checkpoint_of_it(tmp_path, capsys):
    """A learning rate of 1e30 makes step 2's gradients NaN. The run used to go on to the next logged
    step, saving checkpoints of NaN weights on the way, and end in a FloatingPointError traceback with a
    bare NaN in metrics.jsonl."""
    args = small_args(
        tmp_path,
        "blowup",
        "--training.steps",
        "6",
        "--metrics.log_freq",
        "5",
        "--optimizer.lr",
        "1e30",
        "--lr_scheduler.warmup_steps",
        "0",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
    )
    status, err = in_process(capsys, args)
    assert status == 3, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("titanrush: stopped")]
    assert len(lines) == 1 and "step 2: non-finite" in lines[0] and "gradient norm nan" in lines[0], err
    assert "Traceback" not in err
    run = tmp_path / "blowup"
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-1"]
    assert finite_weights(run / "checkpoint" / "step-1")
    rows = read_rows(run)  # strict JSON
    assert rows[-1] == {"step": 2, "attempt": 1, "stop": "non-finite"}


def test_skip_mode_keeps_the_weights_and_stops_after_max_skips_in_a_row(tmp_path):
    """on_nonfinite = skip: a NaN step leaves weights and optimizer state as they were and training goes
    on; more than max_skips non-finite steps in a row stop the run."""
    from titanrush.run.nonfinite import NonFiniteError

    args = small_args(
        tmp_path,
        "skip",
        "--training.steps",
        "8",
        "--training.on_nonfinite",
        "skip",
        "--training.max_skips",
        "1",
        tiny=False,  # (the loss must fall over steps 1-4)
    )
    cfg = config.load(None, args)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    bad_steps = {3, 5, 6}
    trainer.model.output.register_forward_hook(
        lambda m, i, out: out * float("nan") if trainer.step in bad_steps else None
    )
    try:
        trainer.train(stop_at=2)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        adam_step = [float(s["step"]) for s in trainer.optimizer.state.values()]
        trainer.train(stop_at=3)  # the NaN step
        after = trainer.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert [float(s["step"]) for s in trainer.optimizer.state.values()] == adam_step
        with pytest.raises(NonFiniteError, match="step 6: non-finite loss nan.*2 non-finite steps in a row"):
            trainer.train()
    finally:
        trainer.close()
    rows = {r["step"]: r for r in read_rows(tmp_path / "skip") if "lr" in r}
    assert rows[3]["skipped"] == 1 and rows[3]["loss"] is None and rows[3]["grad_norm"] is None
    assert all(math.isfinite(rows[s]["loss"]) for s in (1, 2, 4)) and rows[4]["loss"] < rows[1]["loss"]
    assert 6 not in rows  # the stopping step logs its stop, no metrics


def test_a_non_finite_loss_poisons_the_gradient_norm_even_when_its_gradient_is_finite():
    """The loss's part of the check rides on the global gradient norm (no collective of its own)."""
    from titanrush.parallel.grad_clip import clip_grad_norm_
    from titanrush.run.nonfinite import poison

    w = torch.nn.Parameter(torch.ones(3))
    loss = (w * 2).sum() + torch.tensor(float("inf"))  # infinite, with a finite gradient
    poison(loss).backward()
    assert not torch.isfinite(clip_grad_norm_([w], max_norm=1.0))
    w.grad = None
    poison((w * 2).sum()).backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))  # a finite loss: the same gradient as without


# ------------------------------------------------------------------------------------------------
# Refused runs: exit 2, nothing written


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """A finished run with a checkpoint and a multi-line description, for the refusals below."""
    dump = tmp_path_factory.mktemp("runs")
    logging.getLogger("titanrush").handlers.clear()
    status = train.main(
        small_args(
            dump, "first", "--training.steps", "1", "--checkpoint.enable", "--job.description", DESCRIPTION
        )
    )
    assert status == 0
    return dump / "first"


DESCRIPTION = 'two lines:\n"quoted" \\ back\tslash'


def test_a_multi_line_description_round_trips_through_config_toml(first_run):
    assert config.load(str(first_run / "config.toml")).job.description == DESCRIPTION


REFUSED = {
    "bad value": ["--training.steps", "0"],
    "bad degrees": ["--parallelism.tp", "3"],
    "missing resume checkpoint": ["--checkpoint.load_path", "/nonexistent/step-5"],
    "incompatible checkpoint": ["--model.vocab_size", "9000", "--checkpoint.load_path", "FIRST"],
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_run_exits_2_and_leaves_no_run_folder(case, tmp_path, capsys, first_run):
    ckpt = str(first_run / "checkpoint")
    args = [ckpt if a == "FIRST" else a for a in REFUSED[case]]
    status, err = in_process(capsys, small_args(tmp_path, "refused", *args))
    assert status == 2 and [x for x in err.splitlines() if "error" in x][-1].startswith(
        "titanrush: config error:"
    )
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("case", ["bad value", "incompatible checkpoint"])
def test_a_refused_run_leaves_an_existing_run_folder_as_it_was(case, capsys, first_run):
    """Today's refused resume of an existing run (its own checkpoint does not fit the changed model)."""

    def files() -> dict[str, bytes]:  # (the lock file only names its last holder)
        return {p.name: p.read_bytes() for p in first_run.iterdir() if p.is_file() and p.name != ".lock"}

    before = files()
    extra = ["--model.vocab_size", "9000", "--checkpoint.enable"] if case != "bad value" else REFUSED[case]
    status, err = in_process(capsys, small_args(first_run.parent, "first", *extra))
    assert status == 2, err
    assert files() == before and "config.toml" in before


def test_a_second_run_cannot_take_a_locked_run_folder(tmp_path, capsys):
    folder = tmp_path / "busy"
    folder.mkdir()
    held = run_dir.RunLock()
    assert held.acquire(folder) == ""  # a live run holds it
    try:
        status, err = in_process(capsys, small_args(tmp_path, "busy", "--training.steps", "1"))
    finally:
        held.release()
    assert status == 2 and f"run folder {folder} is in use by another run (pid {os.getpid()}" in err, err
    assert not (folder / "config.toml").exists()


# ------------------------------------------------------------------------------------------------
# Signals, the launcher, attempts


def test_sigterm_finishes_the_step_saves_and_a_rerun_resumes_as_a_new_attempt(tmp_path):
    args = small_args(
        tmp_path, "term", "--training.steps", "1000", "--checkpoint.enable", "--checkpoint.interval", "500"
    )
    child = Child([sys.executable, "-m", "titanrush.train", *args])
    child.wait_for("step 2  loss")
    child.proc.send_signal(signal.SIGTERM)
    status, log = child.finish()
    assert status == 128 + signal.SIGTERM, log[-3000:]
    stops = [x for x in log.splitlines() if x.startswith("titanrush: stopped by SIGTERM after step")]
    assert len(stops) == 1 and "Traceback" not in log, log[-3000:]
    step = int(stops[0].split("after step ")[1].split(":")[0])
    assert f"checkpoint of step {step} saved" in stops[0]
    run = tmp_path / "term"
    assert (run / "checkpoint" / f"step-{step}").is_dir()
    assert read_rows(run)[-1] == {"step": step, "attempt": 1, "stop": "SIGTERM"}
    # The run's summary names the step and the command that resumes: this one.
    lines = log.splitlines()
    assert any(f"run summary: attempt 1, stopped by SIGTERM after step {step} of 1000" in x for x in lines)
    resume = lines[lines.index(f"  resume (from step-{step}):") + 1]
    assert shlex.split(resume)[1:] == ["-m", "titanrush.train", *args], resume
    # The same command, to one step further: attempt 2 resumes the series after that step.
    more = small_args(
        tmp_path,
        "term",
        "--training.steps",
        str(step + 1),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "500",
    )
    assert train.main(more) == 0
    rows = read_rows(run)
    assert [r["step"] for r in rows if r.get("attempt") == 2 and "loss" in r] == [step + 1]
    assert (run / "config.attempt-1.toml").exists() and (run / "config.toml").exists()


@pytest.mark.parallel
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGINT reaches only rank 1 (rank 0 never sees it): both stop after the same step, and the
    checkpoint of that step is complete."""
    args = small_args(
        tmp_path,
        "int",
        "--training.steps",
        "1000",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "500",
        "--metrics.all_ranks",
    )
    child = Child(launcher(2, ["-m", "titanrush.train", *args]))
    child.wait_for("step 2  loss")
    workers = sorted(children(child.proc.pid))
    assert len(workers) == 2, workers
    rank1 = [p for p in workers if "RANK=1" in Path(f"/proc/{p}/environ").read_text().split("\0")]
    os.kill(rank1[0], signal.SIGINT)
    status, log = child.finish()
    assert status != 0, log[-3000:]  # (torchrun reports the workers' exit status 130)
    run = tmp_path / "int"
    stops = [read_rows(run, name)[-1] for name in ("metrics.jsonl", "metrics_rank1.jsonl")]
    assert stops[0] == stops[1] and stops[0]["stop"] == "SIGINT", stops
    assert (run / "checkpoint" / f"step-{stops[0]['step']}" / ".metadata").exists()
    assert "titanrush: stopped by SIGINT after step" in log, log[-3000:]


@pytest.mark.parallel
def test_workers_end_when_their_launcher_is_killed(tmp_path):
    """kill -9 of torchrun: its workers (in sessions of their own) get SIGTERM from the kernel and stop;
    with checkpoint.save_on_signal = false they save nothing, and the run folder's lock is free again."""
    args = small_args(
        tmp_path,
        "orphans",
        "--training.steps",
        "1000",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "500",
        "--no-checkpoint.save_on_signal",
    )
    child = Child(launcher(2, ["-m", "titanrush.train", *args]))
    child.wait_for("step 2  loss")
    workers = children(child.proc.pid)
    assert len(workers) == 2, workers
    os.kill(child.proc.pid, signal.SIGKILL)
    try:
        child.finish(timeout=120)  # (the output ends when the last worker has closed it)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(alive(p) for p in workers), "the workers outlived their launcher"
    finally:
        for pid in filter(alive, workers):  # (never leave them training)
            os.kill(pid, signal.SIGKILL)
    assert not list((tmp_path / "orphans" / "checkpoint").glob("step-*"))
    lock = run_dir.RunLock()
    assert lock.acquire(tmp_path / "orphans") == ""
    lock.release()


# ------------------------------------------------------------------------------------------------
# Honest numbers (#30)


def test_step_time_counts_training_only_and_the_loss_is_the_window_mean(tmp_path):
    """A slow validation at step 3 (its forward sleeps 3 s) lands in val_time_s, not in step 4's
    step_time or tokens/s. The logged loss is the mean of the steps since the last log (steps 2 and 3),
    loss_last the last step's, against a run that logs every step."""
    val = ("--training.steps", "4", "--validation.freq", "3", "--validation.steps", "1")
    cfg = config.load(None, small_args(tmp_path, "timing", *val, "--metrics.log_freq", "3"))
    timed = Trainer(cfg, build_plan(cfg, 1))
    timed.model.register_forward_pre_hook(lambda m, a: time.sleep(3.0) if not m.training else None)
    cfg = config.load(None, small_args(tmp_path, "every", *val))
    for trainer in (timed, Trainer(cfg, build_plan(cfg, 1))):
        try:
            trainer.train()
        finally:
            trainer.close()
    rows = read_rows(tmp_path / "timing")
    (val_row,) = [r for r in rows if "val_loss" in r]
    steps = {r["step"]: r for r in rows if "step_time" in r}
    assert sorted(steps) == [1, 3, 4] and val_row["step"] == 3 and val_row["val_time_s"] >= 3.0
    # Step 4 alone is the window after the validation: counted in, it would take over 3 s (a training
    # step of this run takes 0.1 to 0.5 s, a few times that on a crowded host).
    assert steps[4]["step_time"] < val_row["val_time_s"] / 2, (steps[4], val_row)
    assert steps[4]["tps"] == pytest.approx(64 / steps[4]["step_time"], rel=1e-6)  # 2 x 32 tokens
    every = {r["step"]: r["loss"] for r in read_rows(tmp_path / "every") if "step_time" in r}
    assert steps[3]["loss"] == pytest.approx((every[2] + every[3]) / 2, rel=1e-6)
    assert steps[3]["loss_last"] == pytest.approx(every[3], rel=1e-6)
