"""End-to-end runs of the trainer on the debug model (CPU)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from titanrush import config
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tps",
    "tflops",
    "mfu",
    "mem_active_gib",
    "mem_reserved_gib",
    "data_wait_pct",
}


def small(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        name,
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--training.deterministic",
        "--lr_scheduler.warmup_steps",
        "2",
        *extra,
    ]


def run_inprocess(args: list[str]) -> list[float]:
    cfg = config.load(None, args)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        return trainer.train()
    finally:
        trainer.close()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_debug_run_learns_and_writes_every_sink(tmp_path):
    """The README's main command, shortened: the loss falls and all three sinks parse."""
    res = subprocess.run(
        [
            str(ROOT / "run_train.sh"),
            *small(tmp_path, "e2e", "--training.steps", "25", "--metrics.log_freq", "5"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "NGPU": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "e2e"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25]
    for r in rows:
        assert set(r) >= REQUIRED_KEYS
        assert r["mfu"] is None  # CPU: no peak, no MFU
        assert r["tps"] > 0 and r["tflops"] > 0 and math.isfinite(r["loss"])
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, [r["loss"] for r in rows]
    assert "MFU: not reported (CPU" in res.stderr and "no mfu series" in res.stderr
    # The set-up's stages, each with its seconds.
    setup = re.search(r"set-up ([\d.]+) s: (.*)", res.stdout)  # (progress: stdout)
    assert setup, res.stderr[-3000:]
    stages = dict(re.findall(r"(\D+?) ([\d.]+)(?:, |$)", setup[2]))
    known = {"process group", "mesh", "model on meta", "parallelize", "weights", "optimizer", "data"}
    assert "weights" in stages and set(stages) <= known | {"checkpoint, metrics"}, stages
    assert all(float(s) >= 0.1 for s in stages.values()), stages  # (shorter stages are left out)
    assert len(setup[0]) <= 100, setup[0]
    assert sum(map(float, stages.values())) <= float(setup[1]) + 0.05 * len(stages)
    assert (run_dir / "config.toml").exists()
    resolved = config.load(str(run_dir / "config.toml"))
    assert resolved.training.steps == 25
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / "attempt-1"))
    acc.Reload()
    assert {"loss", "grad_norm", "lr", "tps"} <= set(acc.Tags()["scalars"])
    assert len(acc.Scalars("loss")) == len(rows)


@pytest.mark.parametrize("env", ["NGPU=0", "NGPU=-1", "NGPU=1.5", "NGPU=abc", "NNODES=0", "NNODES=two"])
def test_launcher_refuses_bad_process_counts(tmp_path, env):
    """run_train.sh's NGPU / NNODES: one line naming the variable, exit 2, no launch, nothing written."""
    name, value = env.split("=")
    res = subprocess.run(
        [str(ROOT / "run_train.sh"), *small(tmp_path, "bad")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, name: value},
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip() == f"run_train.sh: error: {env} must be a whole number >= 1"
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "env, said",
    [
        ({}, "NNODES=2 needs NODE_RANK (this node's index, 0 to 1) and RDZV_ENDPOINT"),
        ({"NODE_RANK": "0"}, "NNODES=2 needs NODE_RANK"),
        ({"NODE_RANK": "2", "MASTER_ADDR": "node0"}, "NODE_RANK=2 must be a whole number from 0 to 1"),
        (
            {"NODE_RANK": "x", "RDZV_ENDPOINT": "node0:29500"},
            "NODE_RANK=x must be a whole number from 0 to 1",
        ),
    ],
)
def test_launcher_refuses_a_multi_node_job_without_its_rendezvous(tmp_path, env, said):
    """NNODES > 1 without where to meet: one line naming the variables, exit 2, before any check or launch."""
    unset = ("NODE_RANK", "MASTER_ADDR", "RDZV_ENDPOINT")
    base = {k: v for k, v in __import__("os").environ.items() if k not in unset}
    res = subprocess.run(
        [str(ROOT / "run_train.sh"), *small(tmp_path, "bad")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "NNODES": "2", **env},
    )
    assert res.returncode == 2 and res.stderr.startswith("run_train.sh: error: ") and said in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists(), res.stderr


def test_check_of_a_several_process_job_runs_once(tmp_path):
    """`NGPU=2 ./run_train.sh --check`: one check for the job's world size, not one more per rank."""
    env = {**__import__("os").environ, "NGPU": "2"}
    cmd = [str(ROOT / "run_train.sh"), "--check", *small(tmp_path, "c")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout == "config OK\n", res.stdout + res.stderr[-2000:]
    bad = subprocess.run(
        [*cmd, "--parallelism.tp", "3"], capture_output=True, text=True, timeout=120, env=env
    )
    assert bad.returncode == 2 and "do not divide the world size 2" in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "c").exists()


def test_a_process_whose_peers_never_connect_stops_with_the_timeout_named(tmp_path):
    """Rank 0 of two started alone: the rendezvous waits job.collective_timeout for rank 1, then one line
    naming the setting (it was a DistStoreError traceback), exit 1, and no run folder."""
    import os
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        **dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"),
        **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
    }
    cmd = [
        sys.executable,
        "-m",
        "titanrush",
        "train",
        *small(tmp_path, "alone"),
        "--job.collective_timeout",
        "1",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    said = [line for line in res.stderr.splitlines() if line.startswith("titanrush: ")]
    assert len(said) == 1 and said[0].startswith(
        "titanrush: error: the job's 2 processes did not all connect"
    ), said
    assert "job.collective_timeout = 1 s" in said[0], said
    assert not (tmp_path / "alone").exists()


def test_gradient_accumulation_equals_one_larger_batch(tmp_path):
    one = run_inprocess(small(tmp_path, "one", "--training.steps", "4", "--training.local_batch_size", "4"))
    acc = run_inprocess(
        small(
            tmp_path,
            "acc",
            "--training.steps",
            "4",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "4",
        )
    )
    assert len(one) == len(acc) == 4
    for a, b in zip(one, acc):
        assert a == pytest.approx(b, rel=1e-5)
    g_one = [r["grad_norm"] for r in read_metrics(tmp_path / "one")]
    g_acc = [r["grad_norm"] for r in read_metrics(tmp_path / "acc")]
    assert g_one == pytest.approx(g_acc, rel=1e-4)


def test_same_seed_repeats_the_run_bitwise(tmp_path):
    a = run_inprocess(small(tmp_path, "a", "--training.steps", "3"))
    b = run_inprocess(small(tmp_path, "b", "--training.steps", "3"))
    c = run_inprocess(small(tmp_path, "c", "--training.steps", "3", "--training.seed", "7"))
    assert a == b
    assert a != c


def test_global_batch_not_a_multiple_is_an_error(tmp_path):
    with pytest.raises(config.ConfigError, match="must be a multiple of local_batch_size"):
        cfg = config.load(None, small(tmp_path, "bad", "--training.global_batch_size", "6"))
        Trainer(cfg, build_plan(cfg, 1))


def test_validation_logs_loss_and_perplexity(tmp_path):
    run_inprocess(
        small(tmp_path, "val", "--training.steps", "4", "--validation.freq", "2", "--validation.steps", "2")
    )
    rows = [r for r in read_metrics(tmp_path / "val") if "val_loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-6)


def test_a_run_longer_than_its_data_warns_once_before_training(tmp_path):
    (tmp_path / "tiny.txt").write_text("a few words only, " * 20)
    data = ["--data.dataset", "files", "--data.path", str(tmp_path / "tiny.txt"), "--training.steps", "2"]
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)  # (the trainer's logging setup may stop propagation)
    handler.emit = records.append
    logging.getLogger("titanrush").addHandler(handler)
    try:
        run_inprocess(small(tmp_path, "tiny", *data))
    finally:
        logging.getLogger("titanrush").removeHandler(handler)
    said = [r.getMessage() for r in records if "passes over the" in r.getMessage()]
    assert len(said) == 1 and "from step 1 on it reads tokens it has read before" in said[0], said


def test_bf16_and_chunked_loss_track_the_fp32_plain_run(tmp_path):
    """bf16 with the chunked loss (100-token chunks of the 4 x 64 tokens) against the fp32 plain loss from
    the same seed and batches: the same losses and gradient norms to bf16's rounding at every step (a
    chunk dropped, a wrong mean or a mis-scaled gradient is far outside it), and the loss falls."""
    steps = ("--training.steps", "4")
    ref = run_inprocess(small(tmp_path, "fp32", *steps))
    losses = run_inprocess(
        small(
            tmp_path,
            "bf16",
            *steps,
            "--training.precision",
            "bf16",
            "--training.loss",
            "chunked",
            "--training.loss_chunk_size",
            "100",
        )
    )
    assert losses == pytest.approx(ref, rel=1e-2), (losses, ref)
    grads = [[r["grad_norm"] for r in read_metrics(tmp_path / name)] for name in ("bf16", "fp32")]
    assert grads[0] == pytest.approx(grads[1], rel=5e-2), grads
    assert losses[-1] < losses[0] - 1.0, losses  # measured 9.30 -> 7.03


def test_profiling_writes_perfetto_traces(tmp_path):
    import gzip

    run_inprocess(
        small(
            tmp_path,
            "prof",
            "--training.steps",
            "8",
            "--profiling.enable",
            "--profiling.freq",
            "4",
            "--profiling.active_steps",
            "2",
        )
    )
    traces = sorted((tmp_path / "prof" / "profile").glob("step-*/rank0.trace.json.gz"))
    assert [t.parent.name for t in traces] == ["step-4", "step-8"]
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("ProfilerStep#") for n in names)
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)
    # The summary beside the trace: per-step time by kind, the matmuls among them, and the top ops.
    summary = (traces[0].parent / "rank0.summary.txt").read_text()
    assert "CPU op self time per step over 2 recorded step(s)" in summary
    kinds = dict(line.split()[:2] for line in summary.split("\n\n")[0].splitlines()[1:])
    assert float(kinds["matmul"]) > 0 and "aten::mm" in summary


def test_time_summary_counts_kernels_once_and_by_kind():
    # A GPU trace in miniature: two kernels per step plus the annotation ranges that wrap them on the
    # GPU timeline (step markers, compiled-graph calls), which must not be counted again.
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from titanrush.profiling import time_summary

    def ev(name: str, us: float, annotation: bool = False) -> SimpleNamespace:
        span = SimpleNamespace(elapsed_us=lambda: us)
        cuda = DeviceType.CUDA
        return SimpleNamespace(name=name, device_type=cuda, time_range=span, is_user_annotation=annotation)

    events = []
    for _ in range(2):
        events += [ev("ProfilerStep#5", 9000), ev("## Call CompiledFxGraph abc ##", 5000, annotation=True)]
        events += [ev("nvjet_sm90_tst_128x256_NTN", 3000), ev("triton_poi_fused_mul_silu_0", 1000)]
        events += [ev("ncclDevKernel_AllGather_RING_LL", 500)]
    prof = SimpleNamespace(events=lambda: events, key_averages=lambda: [])
    summary = time_summary(prof, steps=2)
    head = summary.split("\n\n")[0].splitlines()
    assert head[0] == "device (kernel) self time per step over 2 recorded step(s): 4.5 ms"
    kinds = {line.split()[0]: float(line.split()[1]) for line in head[1:]}
    assert kinds == {"matmul": 3.0, "compiled": 1.0, "communication": 0.5}
    assert "ProfilerStep" not in summary and "CompiledFxGraph" not in summary


def test_allocator_setting_goes_through_the_environment_and_leaves_a_set_one():
    from titanrush.distributed import set_allocator_env

    env: dict[str, str] = {}
    set_allocator_env(env, expandable=True)
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    set_allocator_env(env, expandable=True)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}  # the user's wins


@pytest.mark.parametrize(
    "env, named",
    [
        ({"RANK": "abc"}, "RANK='abc'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
        ({"WORLD_SIZE": "\u0662"}, "WORLD_SIZE="),  # a digit to str.isdigit, not to int()
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be below WORLD_SIZE=2"),
    ],
)
def test_a_bad_launch_environment_is_named_before_anything_starts(monkeypatch, capsys, env, named):
    from titanrush import train

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(train, "_check_or_train", lambda *a: pytest.fail("went on past a bad environment"))
    assert train.main(["--check"]) == 2
    err = capsys.readouterr().err
    assert named in err and "run_train.sh" in err and "Traceback" not in err


def test_the_launch_environment_gives_the_ranks():
    from titanrush.launch_env import Ranks, ranks_from_env

    assert ranks_from_env({}) == Ranks(0, 1, 0) == ranks_from_env({"RANK": "", "WORLD_SIZE": ""})
    assert ranks_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": " 1\n"}) == Ranks(3, 4, 1)


def test_a_model_too_large_for_the_host_is_one_line_with_the_fix(tmp_path, capsys):
    from titanrush import train

    # a 4e9-token table of width 256 (4 TB, within the config's bound on one weight) cannot be allocated
    # on this host: the trainer says so, no traceback
    argv = ["--model.vocab_size", "4000000000", "--job.dump_folder", str(tmp_path), "--training.steps", "1"]
    assert train.main(argv) == 2  # (refused before the build: a GPU config, titanrush.run.machine)
    assert "this config needs 1 CUDA GPU of ~" in capsys.readouterr().err
    assert train.main([*argv, "--plan.memory_check", "false"]) == 1  # (built anyway)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "titanrush: error: out of memory on rank 0: DefaultCPUAllocator"
    )
    assert "titanrush estimate" in err[0] and "model.vocab_size" in err[0]


def test_a_gpu_out_of_memory_is_one_line_and_other_failures_keep_their_traceback(monkeypatch, capsys):
    import torch

    from titanrush import train, trainer

    def raising(error):
        def build(cfg, plan):
            raise error

        return build

    msg = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB\nSECOND LINE"
    )
    monkeypatch.setattr(trainer, "Trainer", raising(torch.OutOfMemoryError(msg)))
    assert train.main(["--training.steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "titanrush: error: out of memory on rank 0: CUDA out of memory. Tried to allocate 2.00 GiB" in err
    assert "SECOND LINE" not in err  # the first line of torch's message only
    monkeypatch.setattr(trainer, "Trainer", raising(RuntimeError("an unrelated bug")))
    with pytest.raises(RuntimeError, match="an unrelated bug"):
        train.main(["--training.steps", "1"])


@pytest.mark.parametrize("interrupted", [True, False])
def test_a_second_ctrl_c_whose_close_finds_the_other_ranks_gone_is_an_interrupt(
    monkeypatch, capsys, tmp_path, interrupted
):
    """Under torchrun both ranks stop at once on a second Ctrl-C; the one that gets there second waits in
    close() on a collective the other has left. That gloo error is the interrupt's, not a lost rank's."""
    import signal

    from titanrush import train, trainer

    gone = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    class Stopped:
        attempt, step, run_dir = 1, 0, tmp_path

        def __init__(self, cfg, plan):
            pass

        def train(self):
            if interrupted:
                raise KeyboardInterrupt

        def summarize(self, **kw):
            pass

        def close(self):
            raise gone

    monkeypatch.setattr(trainer, "Trainer", Stopped)
    status = train.main(["--training.steps", "1"])
    err = capsys.readouterr().err
    if interrupted:
        assert status == 128 + signal.SIGINT
        assert "titanrush: interrupted: stopped at once, nothing saved (exit status 130)" in err
        assert "lost another rank" not in err
    else:
        assert status == 1
        assert "titanrush: error: rank 0 lost another rank of the job" in err
        assert "interrupted" not in err


@pytest.mark.parametrize("gc_freq, collecting", [("50", False), ("0", True)])
def test_launch_builds_the_trainer_with_the_collector_off(monkeypatch, gc_freq, collecting):
    import gc

    from titanrush import train

    seen = []
    monkeypatch.setattr(
        train, "_check_or_train", lambda cfg, check, ranks, launch, **kw: seen.append(gc.isenabled()) or 0
    )
    monkeypatch.setattr(train, "init_logging", lambda **kw: None)
    assert gc.isenabled()
    assert train.main(["--training.gc_freq", gc_freq]) == 0
    assert seen == [collecting]
    assert gc.isenabled()  # as the caller had it
    gc.disable()
    try:
        assert train.main(["--training.gc_freq", gc_freq]) == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_rope_table_covers_the_runs_sequence_length_only():
    from titanrush.models.llama import Llama

    args = build_plan(config.load(None, ["--training.seq_len", "96"]), 1).args
    with torch.device("meta"):
        model = Llama(args)
    assert model.rope.shape[0] == 96  # not 2 x max_seq_len (the flavor's limit)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    assert model.rope.shape[0] == 96
    tokens = torch.randint(0, args.vocab_size, (2, 96))
    assert model(tokens).shape == (2, 96, args.vocab_size)


def test_checkpoints_record_no_rope_table_length_and_a_longer_sequence_is_a_clear_error(tmp_path):
    from titanrush.models.llama import Llama
    from titanrush.models.llama.args import ModelArgs

    cfg = config.load(None, small(tmp_path, "rope"))
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        assert trainer.plan.args.rope_positions == 64
        assert trainer.checkpointer.info["model_args"]["rope_positions"] == 0
        args = ModelArgs(**trainer.checkpointer.info["model_args"])
    finally:
        trainer.close()
    assert args.rope_len == 2 * args.max_seq_len
    with torch.device("meta"):
        short = Llama(dataclasses.replace(args, rope_positions=64))
    with pytest.raises(ValueError, match="RoPE table covers 64 positions"):
        short(torch.zeros(1, 65, dtype=torch.long, device="meta"))


def test_the_8b_config_saves_and_resumes_at_the_debug_size(tmp_path):
    """The main command's settings (compile, selective op AC, bf16, checkpointing), the model shrunk to the
    debug flavor: a run cut off after step 3 saved a full checkpoint at step 2; a second launch resumes
    from it and repeats step 3 as the first had it (model, optimizer, schedule and data restored)."""
    path = str(ROOT / "train_configs" / "llama8b_fsdp.toml")
    small = [
        "--activation_checkpoint.mode",  # (the config's auto picks none on CPU: nothing to fit)
        "selective",
        "--parallelism.fsdp_reshard_after_forward",
        "default",
        "--model.flavor",
        "debug",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "run",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--lr_scheduler.warmup_steps",
        "1",
    ]
    for stop_at in (3, None):
        cfg = config.load(path, [*small, "--training.steps", "4"])
        trainer = Trainer(cfg, build_plan(cfg, 1))
        try:
            trainer.train(stop_at)
        finally:
            trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("ckpt_load_s") is not None and r["step"] == 2 for r in rows)  # resumed from step 2
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]
    first, resumed = rows[2], rows[3]
    assert resumed["loss"] == pytest.approx(first["loss"], rel=1e-5), (first, resumed)
    assert resumed["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-4), (first, resumed)
    assert resumed["lr"] == first["lr"]
