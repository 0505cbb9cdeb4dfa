"""A GPU config on a machine without CUDA (`titanrush.run.machine`): refused by `titanrush train` (run and
--check) and by `titanrush sweep`, in one line, unless --assume-cuda checks it as on the GPUs; the debug
model keeps running here."""

from __future__ import annotations

from pathlib import Path

import pytest

from titanrush import config, train
from titanrush.run import machine
from titanrush.run.machine import Host
from titanrush.tools import rush_runner, sweep

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug.toml")
LLAMA8B = str(ROOT / "train_configs" / "llama8b_fsdp.toml")
LLAMA4 = str(ROOT / "train_configs" / "llama4_1Bx8E.toml")
FAKE_CPU = {"cuda": False, "name": "cpu", "count": 0, "torch": "2.13.0", "host_mem_gib": 24.0}
ROOMY = Host(1, 1e6)  # (a machine with a million GiB: only CUDA-only features make a GPU config)


def check_args(tmp_path: Path, path: str, *extra: str) -> list[str]:
    return [
        "--config",
        path,
        "--check",
        "--job.dump_folder",
        str(tmp_path / "runs"),
        "--data.cache_dir",
        str(tmp_path / "cache"),
        *extra,
    ]


def test_what_makes_a_gpu_config():
    """The debug model is none; CUDA-only features make one whatever the memory; so does a plan whose
    least-memory estimate exceeds the machine's memory, counted over its processes there."""
    assert machine.gpu_need(config.load(DEBUG), 1, Host(1, 24.0)) == ""
    for over, words in [
        (["--parallelism.cp", "2"], "parallelism.cp > 1"),
        (["--model.attn_backend", "flex"], "model.attn_backend = 'flex'"),
        (["--float8.enable", "--training.precision", "bf16"], "float8.enable without float8.emulate"),
        (["--activation_checkpoint.offload_first", "2"], "activation_checkpoint.offload_first"),
    ]:
        need = machine.gpu_need(config.load(DEBUG, over), 2, ROOMY)
        assert need.startswith("this config needs 2 CUDA GPUs of ~") and words in need, need
    emulated = ["--float8.enable", "--float8.emulate", "--training.precision", "bf16"]
    assert machine.gpu_need(config.load(DEBUG, emulated), 1, ROOMY) == ""
    # The 8B: its least-memory plan (full checkpointing, ZeRO-3) is ~130 GiB on one process, 4 x ~37 on 4.
    one = machine.gpu_need(config.load(LLAMA8B), 1, Host(1, 24.0))
    assert one.startswith("this config needs 1 CUDA GPU of ~137 GiB (its plan that needs least memory takes")
    assert "beyond this machine's 24 GiB" in one
    assert "x 4 processes" in machine.gpu_need(config.load(LLAMA8B), 4, Host(4, 100.0))
    assert machine.gpu_need(config.load(LLAMA8B), 4, Host(4, 1000.0)) == ""  # (a big host runs it)
    assert machine.gpu_need(config.load(DEBUG), 1, Host(1, 0.01)).startswith("this config needs 1 CUDA GPU")
    assert 0 < machine.host_memory_gib() < 1e6


def test_check_refuses_the_8b_here_and_assume_cuda_checks_it_as_on_gpus(tmp_path, capsys, monkeypatch):
    """`./run_train.sh --config llama8b_fsdp.toml --check` on this CPU machine: exit 2, one line; with
    --assume-cuda the plan and memory verdict for the GPUs (80 GiB assumed, or plan.gpu_mem_gib)."""
    assert train.main(check_args(tmp_path, LLAMA8B)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("titanrush: config error: this config needs 1 CUDA GPU of ~")
    assert err.endswith(
        "this machine has none: --check --assume-cuda checks it as on the GPUs (--plan.gpu_mem_gib for "
        "their memory, NGPU for their number)"
    )
    assert not (tmp_path / "runs").exists()
    # A run is refused the same way, before anything is built.
    run = [a for a in check_args(tmp_path, LLAMA8B) if a != "--check"]
    assert train.main(run) == 2 and "this config needs 1 CUDA GPU" in capsys.readouterr().err
    assert train.main([*run, "--assume-cuda"]) == 2
    assert "--assume-cuda only checks (a run needs the GPUs): use it with --check" in capsys.readouterr().err
    # As on 4 GPUs (NGPU=4 ./run_train.sh ... --check --assume-cuda): the planner's table, then OK.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert train.main(check_args(tmp_path, LLAMA8B, "--assume-cuda")) == 0
    out = capsys.readouterr().out
    assert out.startswith("auto plan (activation_checkpoint.mode, parallelism.fsdp_reshard_after_forward)")
    assert "for 4 GPU(s) of 80 GiB per GPU (assumed by --assume-cuda; plan.gpu_mem_gib sets it)" in out
    assert out.rstrip().endswith(
        "config OK as on 4 CUDA GPUs of 80 GiB per GPU (assumed by --assume-cuda; plan.gpu_mem_gib sets it)"
    )
    # The memory verdict itself: the 8B on one 141 GiB GPU does not fit (docs/auto_plan.md).
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert train.main(check_args(tmp_path, LLAMA8B, "--assume-cuda", "--plan.gpu_mem_gib", "141")) == 2
    assert "no plan of the auto levers fits the GPU with 5% to spare" in capsys.readouterr().err


def test_the_debug_config_still_checks_and_a_cp_config_is_refused(tmp_path, capsys, monkeypatch):
    assert train.main(check_args(tmp_path, DEBUG)) == 0
    assert capsys.readouterr().out.strip() == "config OK"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(check_args(tmp_path, DEBUG, "--parallelism.cp", "2")) == 2
    err = capsys.readouterr().err
    assert "this config needs 2 CUDA GPUs of ~" in err and "parallelism.cp > 1: ring attention" in err
    assert train.main(check_args(tmp_path, DEBUG, "--parallelism.cp", "2", "--assume-cuda")) == 0
    assert capsys.readouterr().out.startswith("config OK as on 2 CUDA GPUs of 80 GiB per GPU")


def test_sweep_refuses_gpu_shapes_here_and_plans_them_with_assume_cuda(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(rush_runner, "probe_device", lambda: dict(FAKE_CPU))
    out = tmp_path / "sweep"
    argv = ["--config", LLAMA8B, "--ngpu", "4", "--grid", "tp=1,2", "--output", str(out)]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("titanrush sweep: this config needs 4 CUDA GPUs of ~") and "\n" not in err
    assert err.endswith("this machine has none: --dry-run --assume-cuda plans the sweep as on the GPUs")
    assert not out.exists()
    assert sweep.main([*argv, "--dry-run"]) == 2  # (a dry run here plans for this machine too)
    capsys.readouterr()
    assert sweep.main([*argv, "--dry-run", "--assume-cuda"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1",
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1",
    ]
    # The debug model: its cp > 1 shapes need GPUs (invalid, with the way out); the others stay valid.
    grid = ["--grid", "cp=1,2", "--dry-run", "--training.seq_len", "64"]
    assert sweep.main(["--config", DEBUG, "--ngpu", "2", *grid]) == 0
    captured = capsys.readouterr()
    assert captured.out == "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1\n"
    assert "invalid: dp_replicate=1 dp_shard=1 tp=1 pp=1 cp=2: this config needs 2 CUDA GPUs" in captured.err
    assert "note: shapes that need GPUs are invalid here: --dry-run --assume-cuda" in captured.err


@pytest.mark.parametrize("processes", [1, 3])
def test_this_host_counts_the_processes_on_this_machine(monkeypatch, processes):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    assert machine.this_host(8).processes == processes
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert machine.this_host(8).processes == 8


def test_the_llama4_config_fits_one_h200_and_its_settings_train_here_on_the_debug_flavor(
    tmp_path, capsys, monkeypatch
):
    """train_configs/llama4_1Bx8E.toml: refused on a CPU machine of 24 GiB, it checks as on one 141 GiB GPU,
    where auto plans no activation checkpointing; its settings train here on `llama4_debug` (uncompiled)."""
    monkeypatch.setattr(machine, "host_memory_gib", lambda: 24.0)
    assert train.main(check_args(tmp_path, LLAMA4)) == 2
    assert "this config needs 1 CUDA GPU of ~" in capsys.readouterr().err
    assert train.main(check_args(tmp_path, LLAMA4, "--assume-cuda", "--plan.gpu_mem_gib", "141")) == 0
    out = capsys.readouterr().out
    assert 'resolved: activation_checkpoint.mode = "none"' in out and "config OK as on 1 CUDA GPU" in out
    shrunk = ["--model.flavor", "llama4_debug", "--training.seq_len", "128", "--training.steps", "3"]
    shrunk += ["--compile.enable", "false", "--metrics.log_freq", "1", "--no-metrics.tensorboard"]
    run = [a for a in check_args(tmp_path, LLAMA4) if a != "--check"]
    assert train.main([*run, *shrunk]) == 0
    rows = (tmp_path / "runs" / "llama4_1Bx8E" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3 and all("moe_imbalance_window" in row for row in rows)
