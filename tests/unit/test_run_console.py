"""The console of a training run (issue #49): progress and results on stdout, warnings on stderr, a copy
of the console in the run folder (console.log, appended by each attempt), lines that fit a terminal and
name what they show, and an end-of-run summary whose next commands run as printed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from titanrush import config
from titanrush.config import split_args
from titanrush.logging_utils import LINE_WIDTH, ConsoleCopy, format_line, run_heading, short
from titanrush.run.summary import RunSummary, next_commands, summary_lines, with_setting

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^\d\d:\d\d:\d\d step (\d+)  loss ([\d.]+)  ")  # a training row's console line


def small(dump: Path, name: str, *extra: str) -> list[str]:
    return [
        "--job.dump_folder",
        str(dump),
        "--job.name",
        name,
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "1",
        "--no-metrics.tensorboard",
        *extra,
    ]


def env() -> dict[str, str]:
    return {**os.environ, "NGPU": "1", "PYTHONPATH": str(ROOT)}


def titanrush_argv(command: str) -> list[str]:
    """A printed `titanrush ...` command as this checkout runs it (the console script may not be on PATH)."""
    words = shlex.split(command)
    assert words[0] == "titanrush", command
    return [sys.executable, "-m", "titanrush", *words[1:]]


def summary_block(stdout: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(the summary's lines, its named rows, its next commands by what they do) from a run's stdout."""
    lines = stdout.splitlines()
    start = max(i for i, x in enumerate(lines) if " run summary: " in x)
    block = lines[start:]
    rows = dict(re.match(r"  (\S+(?: memory)?) +(.*)", x).groups() for x in block[1 : block.index("next:")])
    nexts, what = {}, None
    for x in block[block.index("next:") + 1 :]:
        if x.startswith("    "):
            nexts[what] = x.strip()
        else:
            what = x.strip().rstrip(":")
    return block, rows, nexts


def training_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_a_run_talks_on_stdout_keeps_its_console_and_its_next_commands_work(tmp_path):
    """`./run_train.sh > log` keeps the step lines and the summary; console.log has the same; the export,
    generate and train-further commands the summary prints run as printed, and the second attempt appends
    to console.log after a heading of its own."""
    args = small(tmp_path, "run", "--training.steps", "3", "--checkpoint.enable")
    args += ["--validation.freq", "2", "--validation.steps", "1"]
    res = subprocess.run(
        [str(ROOT / "run_train.sh"), *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = tmp_path / "run"
    rows = training_rows(run_dir)
    # Every logged step is a line on stdout (none on stderr), showing the loss metrics.jsonl holds.
    shown = [STEP_LINE.match(x) for x in res.stdout.splitlines()]
    shown = [(int(m[1]), m[2]) for m in shown if m]
    assert shown == [(r["step"], f"{r['loss']:.4f}") for r in rows] and rows, res.stdout
    assert not any(STEP_LINE.match(x) for x in res.stderr.splitlines()), res.stderr
    assert "MFU: not reported (CPU" in res.stderr  # (warnings stay on stderr)
    # (a data wait of 5% or more, on a loaded machine, is appended beyond the line's fixed fields)
    lines = [re.sub(r"  data wait \d+%$", "", x) for x in res.stdout.splitlines() if STEP_LINE.match(x)]
    widest = max(lines, key=len)
    assert len(widest) <= LINE_WIDTH, widest
    assert all(name in widest for name in ("loss", "lr", "gnorm", "tok/s", "tflops", "mem")), widest
    assert " tflops 0.00 " not in widest and " tflops 0  " not in widest  # (CPU: small, but not zero)

    # console.log: a heading naming the command, then both streams, line for line.
    console = (run_dir / "console.log").read_text().splitlines()
    assert console[0].startswith("===== attempt 1, ") and "from step 1" in console[0]
    assert shlex.join(args) in console[0], console[0]
    assert [x for x in console if x in set(res.stdout.splitlines())] == res.stdout.splitlines()
    assert [x for x in console if x in set(res.stderr.splitlines())] == res.stderr.splitlines()

    # The summary: this run's steps, its figures and where everything went.
    block, summary, nexts = summary_block(res.stdout)
    last = rows[-1]["step"]
    assert f"attempt 1, reached step {last} (training.steps)" in block[0], block
    assert summary["steps"].startswith(f"{last} (steps 1-{last}), ")
    assert summary["loss"] == f"{rows[-1]['loss']:.4f} (step {last})"
    val = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if "val_loss" in r]
    assert summary["validation"].startswith(f"{val[-1]['val_loss']:.4f} (step {val[-1]['step']})"), summary
    assert summary["MFU"].startswith("not known: ") and "metrics.peak_tflops" in summary["MFU"]
    newest = max((run_dir / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert Path(summary["checkpoint"]) == newest and newest.name == f"step-{last}"
    assert Path(summary["metrics"]) == run_dir / "metrics.jsonl"
    assert Path(summary["console"]) == run_dir / "console.log"
    assert summary["TensorBoard"].startswith("off"), summary  # (--no-metrics.tensorboard)
    assert json.loads((run_dir / "summary.json").read_text())["last_step"] == last

    # The next commands, as printed.
    assert set(nexts) == {
        f"train further (from {newest.name}, to step {2 * last})",
        "export to a Hugging Face folder",
        "generate",
        "plot the metrics (into plot.png)",
    }, nexts
    plot = subprocess.run(
        titanrush_argv(nexts["plot the metrics (into plot.png)"]),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plot.returncode == 0 and (run_dir / "plot.png").exists(), plot.stdout + plot.stderr[-3000:]
    export = subprocess.run(
        titanrush_argv(nexts["export to a Hugging Face folder"]),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    hf = Path(shlex.split(nexts["export to a Hugging Face folder"])[-1])
    assert (hf / "config.json").exists() and (hf / "model.safetensors").exists()
    gen = subprocess.run(
        [*titanrush_argv(nexts["generate"]), "--max-new-tokens", "4"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    prompt = shlex.split(nexts["generate"])[-1]
    assert gen.returncode == 0 and gen.stdout.startswith(prompt), gen.stdout + gen.stderr[-3000:]

    before = (run_dir / "console.log").read_text()
    further = nexts[f"train further (from {newest.name}, to step {2 * last})"]
    more = subprocess.run(
        ["bash", "-c", further], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert [r["step"] for r in training_rows(run_dir) if r["attempt"] == 2] == list(
        range(last + 1, 2 * last + 1)
    )
    block, summary, _ = summary_block(more.stdout)
    assert f"attempt 2, reached step {2 * last}" in block[0]
    assert summary["steps"].startswith(f"{last} (steps {last + 1}-{2 * last}), ")
    after = (run_dir / "console.log").read_text()
    assert after.startswith(before)  # appended, whole lines
    heading = after[len(before) :].splitlines()[0]
    assert heading.startswith("===== attempt 2, ") and f"resuming after step {last}" in heading, heading


def test_a_run_without_checkpoints_says_so_and_how_to_save_them(tmp_path, capsys):
    """No checkpoint: the summary says why and prints the same run with checkpoint.enable."""
    from titanrush import train

    args = small(tmp_path, "plain", "--training.steps", "1", "--data.dataset", "synthetic")
    args += ["--checkpoint.enable", "false"]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    _, summary, nexts = summary_block(out)
    assert summary["checkpoint"] == "none saved (checkpoint.enable = false)"
    (what, command), plot = nexts.items()
    assert what.startswith("save checkpoints") and plot[0].startswith("plot the metrics"), nexts
    words = shlex.split(command)
    assert words[1:3] == ["-m", "titanrush.train"] and "python" in Path(words[0]).name, command
    path, _, overrides = split_args(words[3:])
    again, before = config.load(path, overrides), config.load(None, args)
    assert again.checkpoint.enable and not before.checkpoint.enable
    assert again.training == before.training and again.job == before.job
    # and console.log holds the run's lines (the in-process run's copy too)
    console = (tmp_path / "plain" / "console.log").read_text()
    assert [x for x in out.splitlines() if STEP_LINE.match(x)] == [
        x for x in console.splitlines() if STEP_LINE.match(x)
    ]


def test_a_large_runs_line_fits_the_terminal_and_names_what_it_shows():
    """A dense GPU run's row at its widest (a six-digit step, five-digit tokens/s, MFU, a loss below 10, a
    GPU of 100+ GiB) fits LINE_WIDTH with its time stamp; a small TFLOP/s is shown, not rounded to 0;
    MoE's load is named."""
    row = {
        "step": 999999,
        "loss": 9.9999,
        "loss_last": 9.9,
        "lr": 3e-4,
        "grad_norm": 12.34,
        "tps": 99999.0,
        "tflops": 987.6,
        "mfu": 99.9,
        "mem_active_gib": 120.5,
        "mem_active_pct": 86.0,
        "mem_reserved_gib": 139.9,
        "mem_reserved_pct": 99.0,
        "data_wait_pct": 0.2,
        "step_time": 1.234,
    }
    line = "12:34:56 " + format_line(row)
    assert len(line) <= LINE_WIDTH, (len(line), line)
    assert "mfu 99.9%" in line and "mem 140GiB (99%)" in line and "tok/s 99,999" in line, line
    cpu = format_line({"step": 3, "tflops": 0.00392, "mfu": None, "mem_active_gib": 0.53})
    assert "tflops 0.00392" in cpu and "mem 0.53GiB" in cpu, cpu
    moe = format_line({**row, "moe_imbalance_window": 1.42})
    assert "busiest expert 1.42x mean load" in moe
    assert "data wait" not in format_line({**row, "data_wait_pct": 4.9})  # (the loader keeps up)
    assert format_line({**row, "data_wait_pct": 12.0}).endswith("  data wait 12%")
    assert short(0.000123) != "0.00" and float(short(0.000123)) > 0


def test_with_setting_replaces_every_spelling_of_a_key():
    args = ["--training.steps", "3", "--checkpoint.enable", "--training.steps=4", "--no-checkpoint.enable"]
    assert with_setting(args, "training.steps", "8") == [
        "--checkpoint.enable",
        "--no-checkpoint.enable",
        "--training.steps",
        "8",
    ]
    assert with_setting(args, "checkpoint.enable") == [
        "--training.steps",
        "3",
        "--training.steps=4",
        "--checkpoint.enable",
    ]
    assert with_setting(["--checkpoint.enable", "false", "--x.y", "1"], "checkpoint.enable") == [
        "--x.y",
        "1",
        "--checkpoint.enable",
    ]


def summary(tmp_path: Path, **changes) -> RunSummary:
    fields = dict(
        attempt=1,
        first_step=1,
        last_step=7,
        total_steps=10,
        stopped_by="SIGTERM",
        devices=1,
        tokens=100,
        wall_s=1.0,
        setup_s=0.5,
        train_s=0.4,
        tps=1.0,
        tflops=1.0,
        mfu=None,
        mfu_note="",
        mem_gib=None,
        mem_pct=None,
        mem_note="",
        mem_of="",
        loss=None,
        loss_step=None,
        validation=[],
        run_dir=tmp_path,
        checkpoint=tmp_path / "checkpoint" / "step-7",
        resumable=tmp_path / "checkpoint" / "step-7",
        checkpoint_enable=True,
        checkpoint_interval=5,
        tensorboard=None,
        wandb=None,
        console=None,
        dense=True,
        launcher="NGPU=2 ./run_train.sh",
        args=["--training.steps", "10"],
    )
    return RunSummary(**{**fields, **changes})


def test_a_stopped_run_resumes_with_the_same_command_and_a_moe_is_not_sent_to_generate(tmp_path):
    nexts = dict(next_commands(summary(tmp_path)))
    assert nexts["resume (from step-7)"] == "NGPU=2 ./run_train.sh --training.steps 10"
    moe = next_commands(summary(tmp_path, dense=False, stopped_by=None, last_step=10))
    assert [c for w, c in moe if w.startswith("generate")] == [None]
    assert any(c and c.startswith("titanrush convert --to-hf ") for _, c in moe)
    # a GPU job's block: MFU, the job's tokens/s, the last and the best validation loss
    gpu = summary(tmp_path, devices=4, tps=1000.0, mfu=51.25, mem_gib=70.1, mem_pct=50.0, mem_of="GPU")
    gpu.validation = [(10, 3.5), (20, 3.25), (30, 3.375)]
    rows = dict(re.match(r"  (\S+(?: memory)?) +(.*)", x).groups() for x in summary_lines(gpu)[1:9])
    assert rows["MFU"] == "51.2%" and "(4,000 for the 4 devices)" in rows["throughput"], rows
    assert (
        rows["validation"] == "3.3750 (step 30); best 3.2500 (step 20)"
        and "of the GPU" in rows["peak memory"]
    )
    # a run stopped before its first checkpoint: from step 1 again, and it says so
    (what, command), plot = next_commands(summary(tmp_path, checkpoint=None, resumable=None))
    assert "from step 1" in what and command.endswith("--training.steps 10") and plot[0].startswith("plot")


def test_the_console_copy_keeps_early_lines_and_writes_whole_lines(tmp_path, capsys):
    """Lines before the folder exists wait in memory (a refused run writes no file); a cut-off last line
    of an earlier attempt is removed; an unfinished line is written at close; the streams come back."""
    path = tmp_path / "console.log"
    path.write_text("an earlier attempt's line\nits cut-off li")
    stdout, stderr = sys.stdout, sys.stderr
    copy = ConsoleCopy()
    copy.start()
    print("before the folder")
    print("a warning", file=sys.stderr)
    assert not path.read_text().endswith("folder\n")  # (not yet written)
    copy.attach(path, run_heading(2, 7, "./run_train.sh --x.y 1"))
    print("after", end="")
    print(" it, one line")
    print("unfinished", end="")
    copy.close()
    assert (sys.stdout, sys.stderr) == (stdout, stderr)
    lines = path.read_text().splitlines()
    assert lines[0] == "an earlier attempt's line" and lines[1].startswith("===== attempt 2, ")
    assert "resuming after step 7" in lines[1] and lines[1].endswith("./run_train.sh --x.y 1 =====")
    assert lines[2:] == ["before the folder", "a warning", "after it, one line", "unfinished"]
    assert path.read_text().endswith("\n")
    out, err = capsys.readouterr()
    assert out == "before the folder\nafter it, one line\nunfinished" and err == "a warning\n"

    refused = ConsoleCopy()
    refused.start()
    print("a config error")
    refused.close()
    assert list(tmp_path.iterdir()) == [path]
