"""`titanrush plot RUN_FOLDER`: a PNG of a run from its metrics.jsonl, a panel per metric the run recorded,
and one line with exit status 2 where there is nothing to plot."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titanrush import config
from titanrush.models.llama4.balance import load_stats
from titanrush.run.plan import build_plan
from titanrush.tools import plot
from titanrush.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def _plot(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "titanrush.cli", "plot", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _panels(stdout: str) -> tuple[dict[str, str], dict[str, str]]:
    """(drawn, omitted): each panel the report lists, with the rest of its line."""
    drawn, omitted = {}, {}
    for name, rest in re.findall(r"^  ([^:]+): (.*)$", stdout, re.M):
        if rest.startswith("omitted: "):
            omitted[name] = rest[len("omitted: ") :]
        else:
            drawn[name] = rest
    return drawn, omitted


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking that matplotlib decodes it and that it is not blank."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    pixels = matplotlib.image.imread(str(path))
    assert pixels.std() > 0.05  # (lines and text on white, not an empty canvas)
    width, height = struct.unpack(">II", data[16:24])
    assert pixels.shape[:2] == (height, width)
    return width, height


def test_plot_of_a_debug_run(tmp_path):
    """A CPU run of the debug model with validation: loss (train and validation), gradient norm, learning
    rate, tokens/s and memory drawn; MFU (null on CPU) and the experts' panels (a dense model) left out,
    each with its reason."""
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "run", "--training.steps", "4"]
    args += ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1"]
    args += ["--validation.freq", "2", "--lr_scheduler.warmup_steps", "2", "--metrics.tensorboard", "false"]
    cfg = config.load(None, args)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        trainer.train()
    finally:
        trainer.close()
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("mfu") is None for r in rows) and not any(k.startswith("moe_") for r in rows for k in r)

    res = _plot(str(run_dir))
    assert res.returncode == 0, res.stderr
    drawn, omitted = _panels(res.stdout)
    assert drawn == {
        "loss": "train 4 points, validation 2 points",
        "gradient norm": "gradient norm 4 points",
        "learning rate": "learning rate 4 points",
        "tokens/s": "tokens/s 4 points",
        "peak memory": "peak active 4 points",
    }
    assert set(omitted) == {"MFU", "expert load", "tokens per expert"}
    assert omitted["MFU"].startswith("mfu is null in every row (no peak TFLOP/s for the device: CPU")
    assert "a dense model" in omitted["expert load"]
    out = run_dir / "plot.png"
    assert res.stdout.strip().splitlines()[-1] == f"wrote {out} (5 panels)"
    width, height = _png_size(out)
    assert 1000 <= width <= 2000 and 800 <= height <= 2000, (width, height)  # 2 columns x 3 rows

    res = _plot(str(run_dir), "--out", str(tmp_path / "elsewhere" / "run.png"))  # (its folder made)
    assert res.returncode == 0, res.stderr
    assert _png_size(tmp_path / "elsewhere" / "run.png") == (width, height)


def _moe_rows(step: int, attempt: int, loss: float) -> dict:
    """A training row of a GPU run of a 2-layer, 4-expert MoE, its load metrics from the trainer's own
    `load_stats`."""
    counts = torch.tensor([[10.0, 20.0, 30.0, 40.0], [25.0, 25.0, 25.0, 25.0]])
    row = {"step": step, "attempt": attempt, "loss": loss, "loss_last": loss, "grad_norm": 1.0, "lr": 1e-3}
    row |= {"tps": 1000.0, "tflops": 100.0, "mfu": 40.0, "mem_active_gib": 10.0, "mem_reserved_gib": 12.0}
    row |= load_stats(["0", "1"], counts, routed_tokens=400)
    return row | {"moe_imbalance_window": 1.5, "moe_imbalance_window_mean": 1.2}


def test_plot_of_a_restarted_moe_run_reads_one_series(tmp_path):
    """Two attempts (the second resumed after step 2 and repeats steps 3 and 4), checkpoint, restart and
    stop rows, rows of kinds it does not know and a torn last line: one series, the second attempt's rows
    from step 3 on, every panel drawn (a GPU's MFU, the experts' load)."""
    rows = [_moe_rows(s, 1, 10.0 - s) for s in (1, 2, 3, 4)]
    rows += [{"step": 2, "attempt": 1, "ckpt_mode": "async", "ckpt_save_s": 1.0}, {"step": 4, "stop": "x"}]
    rows += [{"step": 2, "attempt": 2, "restart": 1, "cause": "rank 1 was killed by signal 9"}]
    rows += [_moe_rows(s, 2, 5.0 - s) for s in (3, 4, 5)]
    rows += [{"step": 5, "attempt": 2, "val_loss": 3.0, "val_ppl": 20.0}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    text += (
        '["a list"]\n{"step": "six", "loss": 1, "lr": 1}\n{"kind": "summary"}\n{"step": 6, "attempt": 2, "lo'
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(text)

    series, starts = plot.series_rows(plot.read_rows(run_dir)[1])
    assert [(r["step"], r["attempt"]) for r in series["train"]] == [(1, 1), (2, 1), (3, 2), (4, 2), (5, 2)]
    assert [r["step"] for r in series["validation"]] == [5] and starts == {2: 3}

    assert plot.main([str(run_dir)]) == 0
    res = _plot(str(run_dir))
    assert res.returncode == 0, res.stderr
    drawn, omitted = _panels(res.stdout)
    assert not omitted, omitted
    assert drawn["loss"] == "train 5 points, validation 1 points"
    assert (
        drawn["MFU"] == "MFU 5 points"
        and drawn["peak memory"] == "peak active 5 points, peak reserved 5 points"
    )
    assert drawn["expert load"] == "worst layer 5 points, mean over layers 5 points"
    assert drawn["tokens per expert"] == "2 layers x 4 experts at step 5"
    assert _png_size(run_dir / "plot.png")[1] >= 1200  # 8 panels: 4 rows


def test_a_new_run_in_a_used_folder_replaces_the_earlier_series():
    """An attempt from step 1 (job.overwrite, no checkpoint) is a new run: none of the earlier rows stay."""
    rows = [_moe_rows(s, 1, 1.0) for s in (1, 2, 3, 4)] + [_moe_rows(s, 2, 2.0) for s in (1, 2)]
    series, starts = plot.series_rows(rows)
    assert [(r["step"], r["attempt"]) for r in series["train"]] == [(1, 2), (2, 2)] and starts == {2: 1}


@pytest.mark.parametrize(
    "case, said",
    [
        ("missing", "{p} does not exist: give a run folder (<job.dump_folder>/<job.name>)"),
        ("file", "{p} is a file: give the run folder that holds metrics.jsonl"),
        ("no metrics", "{p} has no metrics.jsonl: not a run folder, or its run has not logged a step yet"),
        ("parent", "{p} has no metrics.jsonl: it holds run folders (a, b): titanrush plot {p}/a"),
        ("empty", "{p}/metrics.jsonl holds no training step yet (empty): nothing to plot"),
        (
            "no step",
            "{p}/metrics.jsonl holds no training step yet (1 rows, none of a training step or a validation): "
            "nothing to plot",
        ),
        ("torn only", "{p}/metrics.jsonl holds no training step yet (empty): nothing to plot"),
        ("metrics folder", "cannot read {p}/metrics.jsonl (Is a directory)"),
        ("out in a file", "cannot write {p}/config.toml/plot.png ({p}/config.toml is a file)"),
    ],
)
def test_nothing_to_plot_is_one_line_and_exit_status_2(tmp_path, capsys, case, said):
    p = tmp_path / "run"
    out = []
    if case == "file":
        p.write_text("")
    elif case == "parent":
        for name in ("b", "a"):
            (p / name).mkdir(parents=True)
            (p / name / "metrics.jsonl").write_text(json.dumps(_moe_rows(1, 1, 1.0)) + "\n")
    elif case != "missing":
        p.mkdir()
    if case == "empty":
        (p / "metrics.jsonl").write_text("")
    elif case == "no step":
        (p / "metrics.jsonl").write_text(json.dumps({"step": 0, "restart": 1, "cause": "x"}) + "\n")
    elif case == "torn only":
        (p / "metrics.jsonl").write_text('{"step": 1, "lo')
    elif case == "metrics folder":
        (p / "metrics.jsonl").mkdir()
    elif case == "out in a file":
        (p / "metrics.jsonl").write_text(json.dumps(_moe_rows(1, 1, 1.0)) + "\n")
        (p / "config.toml").write_text("")
        out = ["--out", str(p / "config.toml" / "plot.png")]
    assert plot.main([str(p), *out]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"titanrush plot: error: {said.format(p=p)}\n"


def test_the_command_exits_2_with_its_line(tmp_path):
    res = _plot(str(tmp_path / "nowhere"))
    assert res.returncode == 2 and res.stdout == ""
    assert (
        res.stderr == f"titanrush plot: error: {tmp_path / 'nowhere'} does not exist: give a run folder "
        "(<job.dump_folder>/<job.name>)\n"
    )
