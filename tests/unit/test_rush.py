"""`titanrush rush`: the pure parts (OOM detection, figures, speedups), the ladder's sequencing on a fake
GPU, the plans of both ladders, a real CPU ladder (and dist, marked parallel) on the debug model, and the
dense-vs-MoE group (its dense shape, its plan, a real CPU run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.models.llama import Llama, ModelArgs
from titanrush.models.llama.model import FeedForward
from titanrush.models.llama4 import Llama4
from titanrush.models.llama4 import model_args as llama4_args
from titanrush.models.llama4.moe import MoE
from titanrush.run.plan import resolve_model_args
from titanrush.tools import rush, rush_moe, rush_runner
from titanrush.tools.rush_runner import FAILED, NEEDS_GPU, NOT_AVAILABLE, OK, OOM, SKIPPED, TIMEOUT, Rung

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug.toml")
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "1", "--data.dataset", "synthetic"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TORCHRUN_OOM = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/titanrush/trainer.py", line 310, in train_step
[rank0]:     total += self._forward_backward(batch)
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 139.8 GiB
E1121 05:40:00.000 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
titanrush.train FAILED
"""
CRASH = """\
Traceback (most recent call last):
  File "x.py", line 1, in <module>
RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x256 and 512x256)
"""


def read_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------
# Pure functions


def test_oom_detection_and_classification():
    assert rush_runner.detect_oom(TORCHRUN_OOM)
    assert rush_runner.detect_oom("RuntimeError: CUDA error: out of memory")
    assert rush_runner.detect_oom("RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
    assert not rush_runner.detect_oom(CRASH)
    status, reason = rush_runner.classify(1, TORCHRUN_OOM)
    assert status == OOM and reason.startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert rush_runner.classify(1, CRASH) == (FAILED, CRASH.splitlines()[-1])
    assert rush_runner.classify(0, "step 3 loss 9.4") == (OK, "")
    assert rush_runner.classify(None, "", timed_out=True)[0] == TIMEOUT
    err = "titanrush: config error: float8.enable: float8 arrives with issue 6; set float8.enable = false\n"
    assert rush_runner.classify(2, err) == (NOT_AVAILABLE, err.split("config error: ")[1].strip())
    assert rush_runner.classify(-9, "")[0] == FAILED
    ours = "[rank1]: titanrush: error: out of memory on rank 1: DefaultCPUAllocator: can't allocate memory\n"
    assert rush_runner.classify(1, ours + "torch...ChildFailedError: x\n") == (OOM, ours[9:].strip())
    assert rush_runner.last_error_line("") == ""
    assert rush_runner.last_error_line("no error here\nlast line\n") == "last line"


def test_summarize_and_speedups():
    rows = [
        {
            "step": 1,
            "loss": 9.0,
            "tps": 10.0,
            "tflops": 1.0,
            "mfu": None,
            "step_time": 30.0,
            "mem_active_gib": 5.0,
            "mem_reserved_gib": 6.0,
        },
        {
            "step": 2,
            "loss": 8.0,
            "tps": 90.0,
            "tflops": 9.0,
            "mfu": None,
            "step_time": 1.2,
            "mem_active_gib": 4.0,
            "mem_reserved_gib": 7.0,
        },
        {"step": 2, "val_loss": 8.5},
        {
            "step": 3,
            "loss": 7.0,
            "tps": 100.0,
            "tflops": 10.0,
            "mfu": None,
            "step_time": 1.0,
            "mem_active_gib": 4.5,
            "mem_reserved_gib": 6.5,
        },
        {
            "step": 4,
            "loss": 6.0,
            "tps": 120.0,
            "tflops": 12.0,
            "mfu": None,
            "step_time": 0.8,
            "mem_active_gib": 4.5,
            "mem_reserved_gib": 6.5,
        },
    ]
    s = rush_runner.summarize(rows, warmup=2)
    assert s["steps_measured"] == 2
    assert s["tps"] == pytest.approx(110.0) and s["tflops"] == pytest.approx(11.0)
    assert s["step_time"] == pytest.approx(0.9)
    assert s["mfu"] is None  # CPU: no peak, no MFU
    assert s["mem_active_gib"] == 5.0 and s["mem_reserved_gib"] == 7.0  # peaks over all steps
    assert s["first_step_s"] == 30.0 and s["final_loss"] == 6.0
    assert rush_runner.speedup(350.0, 100.0) == pytest.approx(3.5)
    assert rush_runner.speedup(None, 100.0) is None
    assert rush_runner.speedup(1.0, 0.0) is None
    assert rush_runner.speedup(1.0, None) is None


def test_read_sweep_best(tmp_path):
    path = tmp_path / "sweep.jsonl"
    rows = [
        {"status": "ok", "tps": 100.0, "mesh": {"dp_shard": 8}},
        {"status": "ok", "tps": 300.0, "overrides": ["--parallelism.dp_shard", "4", "--parallelism.tp", "2"]},
        {"status": "OOM", "tps": None, "mesh": {"dp_shard": 2}},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert rush.read_sweep_best(str(path)) == {"parallelism.dp_shard": "4", "parallelism.tp": "2"}
    path.write_text(json.dumps({"status": "OOM"}))
    with pytest.raises(ValueError):
        rush.read_sweep_best(str(path))


# ----------------------------------------------------------------------------------------------
# The ladder's sequencing on a fake H200: OOM at batch 8, float8 refused by the trainer


FAKE_GPU = {
    "cuda": True,
    "name": "NVIDIA H200",
    "count": 1,
    "capability": [9, 0],
    "mem_gib": 139.8,
    "torch": "2.11.0",
    "flash_sdp": True,
    "cudnn_sdp": True,
    "flash_attn": True,
    "torchao": True,
}
FAKE_TPS = {
    "fp32": 1000.0,
    "bf16": 3500.0,
    "fused-adamw": 3850.0,
    "sdpa": 6700.0,
    "flash-attn": 7000.0,
    "compile": 8000.0,
    "batch-2": 9000.0,
    "batch-4": 9500.0,
    "ac-selective": 8000.0,
    "ac-full": 5700.0,
}


def fake_run_training(cmd: list[str], **kw: Any) -> dict[str, Any]:
    args = dict(zip(cmd[::1], cmd[1:]))
    name, batch = args["--job.name"], int(args["--training.local_batch_size"])
    if args["--float8.enable"] == "true":
        return {
            "status": NOT_AVAILABLE,
            "reason": "float8.enable: float8 arrives with issue 6",
            "wall_s": 1.0,
        }
    if batch >= 8 and args["--activation_checkpoint.mode"] == "none":
        return {"status": OOM, "reason": "torch.OutOfMemoryError: CUDA out of memory.", "wall_s": 1.0}
    return {
        "status": OK,
        "reason": "",
        "tps": FAKE_TPS[name],
        "mfu": 40.0,
        "mem_active_gib": 10.0 * batch,
        "mem_reserved_gib": 11.0 * batch,
        "first_step_s": 2.0,
        "wall_s": 1.0,
    }


def test_ladder_sequencing_on_a_fake_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rush_runner, "probe_device", lambda: dict(FAKE_GPU))
    monkeypatch.setattr(rush_runner, "run_training", fake_run_training)
    out = tmp_path / "rush"
    assert rush.main(["ladder", "--steps", "10", "--warmup", "3", "--output", str(out)]) == 0
    rows = {r["name"]: r for r in read_rows(out)}
    assert list(rows) == [
        "fp32",
        "bf16",
        "fused-adamw",
        "sdpa",
        "flash-attn",
        "compile",
        "batch-2",
        "batch-4",
        "batch-8",
        "ac-selective",
        "ac-full",
        "float8",
    ]
    assert rows["batch-8"]["status"] == OOM and rows["float8"]["status"] == NOT_AVAILABLE
    # Each rung adds to the one before; the side rung (flash-attn) is not built on.
    assert (
        rows["fp32"]["overrides"]["model.flavor"] == "1B"
        and rows["fp32"]["overrides"]["training.seq_len"] == "2048"
    )
    assert rows["compile"]["overrides"]["model.attn_backend"] == "sdpa"
    assert rows["compile"]["overrides"]["optimizer.implementation"] == "fused"
    # AC runs at the batch that did not fit; float8 builds on the largest batch that did, without AC.
    assert rows["ac-selective"]["overrides"]["training.local_batch_size"] == "8"
    assert rows["ac-full"]["overrides"]["activation_checkpoint.mode"] == "full"
    assert rows["float8"]["overrides"]["training.local_batch_size"] == "4"
    assert rows["float8"]["overrides"]["activation_checkpoint.mode"] == "none"
    # Speedups: over the rung it builds on, and over the first.
    assert rows["bf16"]["speedup_prev"] == pytest.approx(3.5)
    assert rows["fused-adamw"]["speedup_prev"] == pytest.approx(1.1)
    assert rows["flash-attn"]["parent"] == "sdpa" and rows["compile"]["parent"] == "sdpa"
    assert rows["ac-full"]["parent"] == "batch-4"
    assert rows["ac-full"]["speedup_prev"] == pytest.approx(5700 / 9500)
    assert rows["batch-4"]["speedup_first"] == pytest.approx(9.5)
    assert rows["batch-8"]["speedup_prev"] is None
    assert rows["fp32"]["env"]["device"] == "NVIDIA H200"
    report = (out / "report.md").read_text()
    assert "| 9 | batch-8 |" in report and "**OOM**" in report and "estimate GiB" in report
    for png in ("ladder_tps.png", "ladder_memory.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "[ 1/" in printed and "ETA" in printed
    assert "batch-16" not in printed.split("[ 9/")[1]  # the doubling stopped at the first OOM

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert {"ladder/tps", "ladder/mem_active_gib", "ladder/speedup_first"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("ladder/tps")] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]


def test_a_second_rush_into_the_same_output_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    ran: list[list[str]] = []

    def counting(cmd: list[str], **kw: Any) -> dict[str, Any]:
        ran.append(cmd)
        return fake_run_training(cmd, **kw)

    monkeypatch.setattr(rush_runner, "probe_device", lambda: dict(FAKE_GPU))
    monkeypatch.setattr(rush_runner, "run_training", counting)
    out = tmp_path / "rush"
    argv = ["ladder", "--steps", "10", "--warmup", "3", "--output", str(out)]
    assert rush.main(argv) == 0
    runs, first = len(ran), {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    for kind in (argv, ["dist", "--ngpu", "2", "--output", str(out)], ["moe", "--output", str(out)]):
        assert rush.main(kind) == 2
        assert capsys.readouterr().err.strip() == (
            f"titanrush rush: --output {out} already holds results.jsonl of an earlier run, which this one "
            "would replace: choose another --output (or move that folder away first)"
        )
    assert len(ran) == runs  # nothing ran
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == first
    assert rush.main([*argv, "--dry-run"]) == 0 and len(ran) == runs  # a dry run writes nothing


# ----------------------------------------------------------------------------------------------
# Plans


def test_ladder_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "rush"
    assert (
        rush.main(["ladder", "--config", DEBUG, "--steps", "3", "--dry-run", "--output", str(out), *SMALL])
        == 0
    )
    printed = capsys.readouterr().out
    for name in (
        "fp32",
        "bf16",
        "fused-adamw",
        "sdpa",
        "flash-attn",
        "compile",
        "batch-2",
        "batch-4",
        "ac-selective",
        "ac-full",
        "float8",
    ):
        assert name in printed
    assert "python -m titanrush.train --config" in printed and "--job.name fp32" in printed
    assert printed.count(NEEDS_GPU) == 4  # sdpa, flash-attn, compile, float8 on this CPU
    assert not out.exists()
    # Every planned run has the estimator's verdict against the one rule's GPU memory (a CPU here: 80
    # GiB, said so), and the tiny runs fit: the AC rungs take twice the last batch tried.
    assert "GPU memory: assuming 80 GiB per GPU (no CUDA device here; pass --gpu-mem)" in printed
    planned = [line for line in printed.splitlines() if line.startswith("        + ")]
    assert len(planned) == 7 and all(line.endswith(" of 80 GiB: fits)") for line in planned), planned
    assert "ac-full          full activation checkpointing at batch 8" in printed


def fake_estimate(cfg: Any, ngpu: int, gpu_mem_gib: float) -> Any:
    """10 GiB per sequence of the local batch."""
    total = 10.0 * cfg.training.local_batch_size
    return type("Est", (), {"total_gib": total, "fits": total <= gpu_mem_gib})()


@pytest.mark.parametrize(
    "device, extra, rule, stop",
    [
        (None, ["--gpu-mem", "30"], "30 GiB per GPU (--gpu-mem)", 4),  # this CPU machine
        (FAKE_GPU, [], "139.8 GiB per GPU (this machine's NVIDIA H200", 16),
    ],
)
def test_ladder_dry_run_stops_the_batch_doubling_where_the_estimator_says(
    monkeypatch, capsys, device, extra, rule, stop
):
    """A dry run predicts the real ladder: the doubling stops at the first batch the estimator says does
    not fit under the GPU memory rule, and the AC rungs take that batch."""
    if device is not None:
        monkeypatch.setattr(rush_runner, "probe_device", lambda: dict(device))
    monkeypatch.setattr(rush_runner, "quick_estimate", fake_estimate)
    argv = ["ladder", "--config", DEBUG, "--dry-run", "--max-doublings", "6", *SMALL, *extra]
    assert rush.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"GPU memory: {rule}" in printed
    gib = rule.split()[0]
    assert f"local_batch_size {stop} (estimate {10 * stop:.1f} of {gib} GiB: does not fit)" in printed
    assert f"local_batch_size {stop // 2} (estimate {5 * stop:.1f} of {gib} GiB: fits)" in printed
    assert f"batch-{2 * stop}" not in printed  # the doubling stopped
    assert f"ac-selective     selective (op) activation checkpointing at batch {stop}" in printed
    assert f"the batch doubling would stop at {stop}" in printed and f"batch {stop // 2} is kept" in printed


def test_dist_dry_run_plan(tmp_path, capsys):
    out = tmp_path / "rush"
    assert (
        rush.main(
            ["dist", "--ngpu", "2", "--config", DEBUG, "--steps", "3", "--dry-run", "--output", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert not out.exists()
    lines = printed.splitlines()
    assert any("NGPU=2 ./run_train.sh" in line and "--job.name ddp-2" in line for line in lines)
    assert "--parallelism.dp_replicate 2 --parallelism.dp_shard 1" in printed  # DDP
    assert "--parallelism.dp_shard 2 --parallelism.fsdp_reshard_after_forward never" in printed  # ZeRO-2
    assert "--parallelism.dp_shard 2 --parallelism.fsdp_reshard_after_forward always" in printed  # ZeRO-3
    hsdp = next(line for line in lines if "hsdp-2" in line)
    assert SKIPPED in hsdp and ">= 4 GPUs" in hsdp
    assert "8b-fsdp-2" in printed and NOT_AVAILABLE in printed
    plan = rush.dist_plan({"cuda": True, "count": 4}, 4, None)
    hsdp4 = next(r for r in plan if r.name == "hsdp-4")
    assert hsdp4.status is None and hsdp4.delta == {
        "parallelism.dp_replicate": "2",
        "parallelism.dp_shard": "2",
    }
    assert [r.name for r in plan if r.ngpu == 4][:3] == ["ddp-4", "zero2-4", "zero3-4"]


@pytest.mark.parametrize("kind", ["ladder", "moe"])
def test_the_gpu_base_on_a_machine_without_cuda_points_to_the_cpu_smoke_run(
    tmp_path, monkeypatch, capsys, kind
):
    """The built-in base (a 1B at seq 2048) on a CPU machine: one ladder rung fit the host's memory and
    trained for minutes a step; it is refused before any run, naming the smoke command, which runs."""
    ran: list[list[str]] = []
    here = rush_runner.probe_device()
    monkeypatch.setattr(rush_runner, "probe_device", lambda: {**here, "cuda": False})
    monkeypatch.setattr(rush_runner, "run_training", lambda cmd, **kw: ran.append(cmd) or {})
    out = tmp_path / "rush"
    assert rush.main([kind, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"`{rush.CPU_SMOKE[kind]}`" in err and "without CUDA" in err, err
    assert not ran and not out.exists()
    assert rush.main([kind, "--training.seqlen", "64", "--output", str(out)]) == 2  # (a typo: its error)
    assert "training.seq_len" in capsys.readouterr().err
    assert rush.main([kind, "--dry-run", "--output", str(out)]) == 0  # the GPU plan is still shown
    smoke = rush.CPU_SMOKE[kind].split()[3:]
    assert smoke[:2] == ["--config", "train_configs/debug.toml"]
    monkeypatch.chdir(Path(DEBUG).parents[1])
    assert rush.main([kind, *smoke, "--dry-run", "--output", str(out)]) == 0  # (its options are valid)


def test_bad_override_is_a_config_error(capsys):
    assert rush.main(["ladder", "--dry-run", "--training.seqlen", "64"]) == 2
    assert "training.seq_len" in capsys.readouterr().err  # the suggestion


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--timeout", "-1"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
        (["--max-batch", "0"], "--max-batch"),
        (["--max-doublings", "-1"], "--max-doublings"),
        (["--warmup", "-1"], "titanrush rush: --warmup must be >= 0"),
        (["--output", DEBUG], "is a file"),
        (["--config"], "argument --config: expected one argument"),  # (not the built-in config)
        (["--steps"], "argument --steps: expected one argument"),
    ],
)
def test_bad_options_exit_2_before_any_run(flags, message, capsys):
    assert rush.main(["ladder", "--config", DEBUG, "--steps", "2", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, code, said", [([], 2, "no command"), (["nope"], 2, "unknown command 'nope'"), (["--help"], 0, "")]
)
def test_a_missing_or_unknown_command_prints_the_usage_and_names_the_problem(argv, code, said, capsys):
    assert rush.main(argv) == code
    out, err = capsys.readouterr()
    assert "titanrush rush ladder" in out and (said in err if said else err == "")


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file"),
        ('{"status": "OOM", "tps": 0}\n', "no OK row with tps"),
        ("not json\n", "Expecting value"),
    ],
)
def test_unusable_sweep_results_exit_2_before_any_run(tmp_path, content, message, capsys):
    path = tmp_path / "sweep.jsonl"
    if content is not None:
        path.write_text(content)
    argv = ["dist", "--config", DEBUG, "--ngpu", "2", "--sweep-results", str(path), "--output", str(tmp_path)]
    assert rush.main(argv) == 2
    err = capsys.readouterr().err
    assert "--sweep-results" in err and message in err and "titanrush sweep" in err
    assert [p.name for p in tmp_path.iterdir()] == ([path.name] if content else [])  # nothing ran


# ----------------------------------------------------------------------------------------------
# Real runs on CPU


def test_cpu_ladder_end_to_end(tmp_path, capsys):
    """The rungs CPU supports run; the others are marked; all three reports are written."""
    out = tmp_path / "rush"
    argv = ["ladder", "--config", DEBUG, "--steps", "3", "--max-doublings", "1", "--output", str(out), *SMALL]
    assert rush.main(argv) == 0
    rows = {r["name"]: r for r in read_rows(out)}
    ran = ["fp32", "bf16", "fused-adamw", "batch-2", "ac-selective", "ac-full"]
    for name in ran:
        assert rows[name]["status"] == OK, (name, rows[name].get("reason"), rows[name].get("log"))
        assert rows[name]["tps"] > 0 and rows[name]["mfu"] is None and rows[name]["first_step_s"] > 0
    for name in ("sdpa", "flash-attn", "compile", "float8"):
        assert rows[name]["status"] == NEEDS_GPU and rows[name]["reason"]
    assert rows["ac-full"]["overrides"]["training.local_batch_size"] == "4"  # 2x the last batch tried
    assert rows["bf16"]["speedup_prev"] == pytest.approx(rows["bf16"]["tps"] / rows["fp32"]["tps"])
    report = (out / "report.md").read_text()
    assert "| # | rung | adds | status | tokens/s |" in report and "torch " in report and "command:" in report
    for name in ran:
        assert f"| {name} |" in report
    for png in ("ladder_tps.png", "ladder_memory.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert "[ 1/" in capsys.readouterr().out


@pytest.mark.parallel
def test_cpu_dist_end_to_end(tmp_path):
    """DDP, ZeRO-2 and ZeRO-3 on 2 gloo processes under torchrun, through ./run_train.sh."""
    out = tmp_path / "rush"
    argv = ["dist", "--ngpu", "2", "--config", DEBUG, "--steps", "3", "--output", str(out), *SMALL]
    assert rush.main(argv) == 0
    rows = {r["name"]: r for r in read_rows(out)}
    for name in ("1gpu", "ddp-2", "zero2-2", "zero3-2"):
        assert rows[name]["status"] == OK, (name, rows[name].get("reason"), rows[name].get("log"))
        assert rows[name]["efficiency"] > 0
    assert rows["hsdp-2"]["status"] == SKIPPED
    assert rows["ddp-2"]["tps_total"] == pytest.approx(2 * rows["ddp-2"]["tps"])
    assert (out / "dist_scaling.png").read_bytes()[:8] == PNG_MAGIC
    assert "| FSDP ZeRO-3 | 2 | 1 x 2 | ok |" in (out / "report.md").read_text()


def test_dist_efficiency_only_for_the_1b_scaling_rungs(monkeypatch):
    """The 8B row runs another model: its tokens/s over the 1B baseline is no scaling efficiency."""
    plan = [
        Rung("1gpu", "1 GPU", {}, "scaling", ngpu=1),
        Rung("zero3-2", "ZeRO-3 on 2 GPUs", {}, "scaling", ngpu=2),
        Rung("8b-fsdp-2", "8B", {}, "8b", ngpu=2),
    ]
    tps = {"1gpu": 1000.0, "zero3-2": 900.0, "8b-fsdp-2": 150.0}
    monkeypatch.setattr(rush.runner, "execute", lambda ctx, rung, s, b: {"status": OK, "tps": tps[rung.name]})
    rows = []
    monkeypatch.setattr(rush, "record", lambda ctx, row: rows.append(row))
    rush.run_dist(None, plan, {})
    assert [r["efficiency"] for r in rows] == [1.0, 0.9, None]


# ----------------------------------------------------------------------------------------------
# Dense vs MoE at equal active parameters


def test_dense_twin_shapes_the_moe_flavors_active_ffn():
    """The dense width is the shared expert's plus top_k routed experts', checked on built modules."""
    assert rush_moe.moe_flavor("debug") == "llama4_debug" and rush_moe.moe_flavor("1B") == "llama4_1Bx8E"
    assert rush_moe.moe_flavor("llama4_1Bx16E") == "llama4_1Bx16E"
    with pytest.raises(ConfigError):
        rush_moe.moe_flavor("8B")
    big = llama4_args("llama4_1Bx8E")
    twin = rush_moe.dense_twin(big)
    assert twin["model.ffn_hidden"] == str(2 * 2816)  # 1 shared + top-1 routed, 2816 wide each
    dense = resolve_model_args(cfgmod.load(None, rush_runner.to_args(twin)))
    assert type(dense) is ModelArgs and dense.ffn_hidden == 5632
    for key in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "tie_embeddings",
        "norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_seq_len",
    ):
        assert getattr(dense, key) == getattr(big, key), key
    variants = [
        llama4_args("llama4_debug"),
        llama4_args("llama4_debug", top_k=2),
        llama4_args("llama4_debug", top_k=2, shared_expert=False),
        llama4_args("llama4_debug", moe_hidden=200),
    ]
    for a in variants:
        hidden, exact = rush_moe.twin_hidden(a)
        assert exact
        with torch.device("meta"):
            ffn = FeedForward(a.dim, hidden)
            moe = MoE(a.dim, a.expert_hidden, a.n_experts, a.top_k, shared_expert=a.shared_expert)
        shared = sum(p.numel() for p in moe.shared_expert.parameters()) if moe.shared_expert else 0
        routed = a.top_k * (moe.experts.w13[0].numel() + moe.experts.w2[0].numel())
        assert sum(p.numel() for p in ffn.parameters()) == shared + routed
    # Dense and MoE layers of different widths: the mean, exact only when it is a whole number.
    mixed = llama4_args("llama4_debug", moe_every=2)
    assert mixed.ffn_hidden == 704 and rush_moe.twin_hidden(mixed) == ((704 + 768) // 2, True)
    assert rush_moe.twin_hidden(llama4_args("llama4_debug", moe_every=2, n_layers=3))[1] is False
    with pytest.raises(ConfigError, match="iRoPE"):
        rush_moe.dense_twin(llama4_args("llama4_17Bx16E"))


def test_moe_dry_run_plan_on_the_gpu_sizes(tmp_path, capsys):
    out = tmp_path / "rush"
    assert rush.main(["moe", "--dry-run", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    assert "dense Llama, FFN hidden 5632: 1.25B parameters, all active" in printed
    assert "llama4_1Bx8E: 1 shared + top-1 of 8 experts x 2816: 3.18B total, 1.25B active" in printed
    dense = next(line for line in printed.splitlines() if "--job.name dense" in line)
    assert "python -m titanrush.train" in dense and "--model.flavor custom" in dense
    assert "--model.ffn_hidden 5632" in dense and "--data.dataset embedded" in dense
    moe = next(line for line in printed.splitlines() if "--job.name moe" in line)
    assert "--model.flavor llama4_1Bx8E" in moe
    # Both at the 1B MoE's learning rate (the shipped llama4_1Bx8E.toml's), an override wins for both.
    assert "--optimizer.lr 3e-4" in dense and "--optimizer.lr 3e-4" in moe
    assert rush.main(["moe", "--dry-run", "--optimizer.lr", "1e-3"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "--job.name" in line]
    assert len(commands) == 2 and all("--optimizer.lr 1e-3" in c and "3e-4" not in c for c in commands)
    assert rush.main(["moe", "--dry-run", "--model.flavor", "8B"]) == 2
    assert "no mixture-of-experts counterpart" in capsys.readouterr().err


def used_by_one_token(model: torch.nn.Module) -> int:
    """Parameters one token's forward and backward touch: every tensor it reaches, and of the stacked
    experts (E, ...) only the experts it was routed to."""
    model.init_weights(seed=0)
    model(torch.tensor([[17]])).float().pow(2).mean().backward()
    used = 0
    for p in model.parameters():
        if p.grad is None or not p.grad.any():
            continue
        used += sum(p[e].numel() for e in range(len(p)) if p.grad[e].any()) if p.dim() == 3 else p.numel()
    return used


def test_cpu_moe_end_to_end(tmp_path, capsys):
    """Both rungs train on the debug sizes; their active parameters agree with an independent count."""
    out = tmp_path / "rush"
    argv = ["moe", "--config", DEBUG, "--steps", "3", "--warmup", "1", "--output", str(out), *SMALL]
    assert rush.main(argv) == 0
    rows = {r["name"]: r for r in read_rows(out)}
    assert list(rows) == ["dense", "moe"]
    for r in rows.values():
        assert r["status"] == OK, (r["name"], r.get("reason"), r.get("log"))
        assert r["tps"] > 0 and r["tflops"] > 0 and r["mem_active_gib"] > 0
        assert [s for s, _ in r["loss_curve"]] == [1, 2, 3] and r["final_loss"] == r["loss_curve"][-1][1]
    dense, moe = rows["dense"], rows["moe"]
    assert (
        moe["overrides"]["model.flavor"] == "llama4_debug" and dense["overrides"]["model.flavor"] == "custom"
    )
    # The models the runs trained, built again here; what one token uses, counted on them.
    models = {}
    for name, r in rows.items():
        args = resolve_model_args(cfgmod.load(DEBUG, rush_runner.to_args(r["overrides"])))
        models[name] = (Llama4 if name == "moe" else Llama)(args)
    used = {name: used_by_one_token(m) for name, m in models.items()}
    routers = sum(m.router.gate.weight.numel() for m in models["moe"].moe_modules())
    assert used["dense"] == dense["params_active"] == dense["params_total"]
    assert used["moe"] == moe["params_active"] and used["moe"] - routers == used["dense"]
    assert (
        moe["params_total"] == sum(p.numel() for p in models["moe"].parameters()) > 2 * moe["params_active"]
    )
    # The comparison: tokens/s ratio, loss at equal steps (= equal tokens).
    assert moe["vs_dense"] == pytest.approx(moe["tps"] / dense["tps"])
    assert moe["loss_step"] == 3 and moe["loss_tokens"] == 3 * 64
    assert moe["loss_diff"] == pytest.approx(moe["final_loss"] - dense["final_loss"])
    report = (out / "report.md").read_text()
    assert "| dense | dense Llama, FFN hidden 768" in report and "| moe | llama4_debug" in report
    assert f"Tokens/s, MoE / dense: {moe['vs_dense']:.2f}x" in report
    assert "at equal steps and equal tokens" in report and f"is the MoE's routers ({routers:,}" in report
    assert "moe_window_worst" not in moe and "too few steps after the warm-up" in report  # (3 steps)
    took = f"took {moe['moe_imbalance']:.2f}x"
    assert f"Routing at the last step: the busiest expert of the most imbalanced layer {took}" in report
    assert (out / "moe.png").read_bytes()[:8] == PNG_MAGIC
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert "[ 2/2] moe" in capsys.readouterr().out


def test_moe_routing_sums_whole_windows_after_the_warm_up():
    """Layer 0 sends each step's 100 tokens to expert 0, then 1, in turn (2.0 at every step, 1.0 over a
    window); layer 1 sends 30 and 10, then from step 13 on 40 and 0. Warm-up 2: windows 3-12 and 13-22;
    steps 23-25 make no whole window; steps 1-2 (the warm-up) would make layer 1 worse if counted."""
    metrics = []
    for step in range(1, 26):
        rows = {"step": step, "loss": 1.0, "moe_tokens_l0": [100, 0] if step % 2 else [0, 100]}
        rows["moe_tokens_l1"] = [40, 0] if step >= 13 or step <= 2 else [30, 10]
        metrics.append(rows)
    got = rush_moe.routing(metrics, warmup=2)
    assert got["moe_window_worst"] == pytest.approx(2.0) and got["moe_window_worst_steps"] == [13, 22]
    assert got["moe_window_last_steps"] == [13, 22] and got["moe_window_last_mean"] == pytest.approx(1.5)
    first = rush_moe.routing(metrics[:20], warmup=2)  # only steps 3-12 whole: layer 1 at 300 / 200
    assert first["moe_window_worst"] == pytest.approx(1.5) and first["moe_window_last_mean"] == 1.25
    assert rush_moe.routing(metrics[:11], warmup=2) == {}
    # A step missing leaves its window out, not the later ones; a layer some step lacks is left out of
    # that window (layer 1 here: only layer 0, balanced, remains in steps 13-22).
    gap = [m for m in metrics if m["step"] != 5]
    assert rush_moe.routing(gap, warmup=2)["moe_window_worst_steps"] == [13, 22]
    uneven = [{k: v for k, v in m.items() if not (m["step"] == 15 and k == "moe_tokens_l1")} for m in metrics]
    got = rush_moe.routing(uneven, warmup=2)
    assert got["moe_window_worst"] == pytest.approx(1.5) and got["moe_window_last"] == pytest.approx(1.0)


def test_a_report_names_the_commit_it_ran_and_says_when_the_tree_differs(tmp_path, monkeypatch):
    import shutil
    import subprocess

    from titanrush.tools.rush_report import git_commit

    if shutil.which("git") is None:
        pytest.skip("git is not installed: a checkout without it reports 'unknown'")
    for var in ("TITANRUSH_COMMIT", "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert git_commit(tmp_path) == "unknown"  # not a checkout
    git = [
        "git",
        "-C",
        str(tmp_path),
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "-c",
        "commit.gpgsign=false",
    ]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert git_commit(tmp_path) == head.stdout.strip()
    (tmp_path / "new.py").write_text("")  # untracked: not a change to what ran
    assert git_commit(tmp_path) == head.stdout.strip()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head.stdout.strip() + "+changes"
    monkeypatch.setenv("TITANRUSH_COMMIT", "abc1234")  # a checkout copied without .git
    assert git_commit(tmp_path) == "abc1234"
