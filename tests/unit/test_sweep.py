"""`titanrush sweep`: grid parsing, the enumeration and validation of shapes, the dry run's output, an OOM
recorded from a fake child, and a real 2-process CPU sweep on the debug model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from titanrush import config as cfgmod
from titanrush.tools import rush, rush_runner, sweep
from titanrush.tools.estimate import estimate
from titanrush.tools.rush_runner import OK, OOM

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug.toml")
TINY = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--data.dataset", "synthetic"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAKE_CPU = {"cuda": False, "name": "cpu", "count": 0, "torch": "2.13.0", "mem_gib": 64.0}


def labels(shapes: list[dict[str, Any]]) -> list[str]:
    return [sweep.label(s) for s in shapes]


def read_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.fixture
def fake_cpu(monkeypatch):
    """Skip the device probe (a child process): this machine is a CPU."""
    monkeypatch.setattr(rush_runner, "probe_device", lambda: dict(FAKE_CPU))


# ----------------------------------------------------------------------------------------------
# Grid


def test_parse_grid():
    grid = sweep.parse_grid("batch=1,2 pp=1,2  tp=1,2,4,2 ac=none,selective reshard=never")
    assert grid == {
        "tp": [1, 2, 4],
        "pp": [1, 2],
        "reshard": ["never"],
        "ac": ["none", "selective"],
        "batch": [1, 2],
    }
    assert list(grid) == ["tp", "pp", "reshard", "ac", "batch"]  # the canonical order, whatever the input's
    assert sweep.default_grid(4) == "tp=1,2,4 pp=1,2,4 cp=1,2,4"
    assert sweep.default_grid(6) == "tp=1,2,3,6 pp=1,2,3,6 cp=1,2,3,6"  # every divisor, not only 2^k


@pytest.mark.parametrize(
    "text, message",
    [
        ("tq=1,2", "unknown grid dimension 'tq'; did you mean 'tp'?"),
        ("color=red", "unknown grid dimension 'color'; dimensions: dp_replicate, dp_shard, tp"),
        ("tp", "grid entry 'tp' must look like dim=v1,v2"),
        ("tp=1 tp=2", "grid dimension 'tp' is given twice"),
        ("tp=", "has no values"),
        ("tp=0,2", "tp values must be positive integers, got '0'"),
        ("batch=two", "batch values must be positive integers, got 'two'"),
        ("ac=some", "ac='some' is not one of none, selective, full"),
        ("reshard=sometimes", "is not one of always, never, default"),
        ("   ", "the grid is empty"),
    ],
)
def test_grid_errors(text, message):
    with pytest.raises(sweep.GridError) as e:
        sweep.parse_grid(text)
    assert message in str(e.value)


def test_unknown_dimension_exits_2(capsys):
    assert sweep.main(["--config", DEBUG, "--ngpu", "4", "--grid", "tp=1,2 mp=2", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "bad --grid: unknown grid dimension 'mp'" in err and "dimensions: dp_replicate" in err


def test_bad_input_exits_2(fake_cpu, capsys):
    assert sweep.main(["--config", DEBUG, "--ngpu", "2", "--dry-run", "--training.seqlen", "64"]) == 2
    assert "training.seq_len" in capsys.readouterr().err  # the config's own suggestion
    assert sweep.main(["--config", DEBUG, "--ngpu", "2", "--assume-cuda"]) == 2
    assert "use it with --dry-run" in capsys.readouterr().err
    assert sweep.main(["--ngpu", "2"]) == 2  # --config is required (argparse's message)
    assert sweep.main(["--config", DEBUG, "--ngpu", "2", "--dry-run", "--gpu-mem", "-1"]) == 2
    assert "--gpu-mem must be a positive number of GiB, got -1.0" in capsys.readouterr().err
    for bad in ("-1", "0", "nan", "inf"):
        assert sweep.main(["--config", DEBUG, "--ngpu", "1", "--dry-run", "--timeout", bad]) == 2
        assert "--timeout" in capsys.readouterr().err
    a_file = Path(DEBUG)  # an existing file is no output folder; nothing runs, nothing is written
    assert sweep.main(["--config", DEBUG, "--ngpu", "1", "--steps", "2", "--output", str(a_file)]) == 2
    assert "is a file" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Enumeration and validation (the debug flavor: 4 layers, 8 heads, 4 KV heads, seq 256)


def test_enumeration_4_gpus():
    valid, invalid = sweep.plan(DEBUG, {}, sweep.parse_grid("tp=1,2,4 pp=1,2"), 4)
    assert labels(valid) == [
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1",
        "dp_replicate=1 dp_shard=2 tp=1 pp=2 cp=1",
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1",
        "dp_replicate=1 dp_shard=1 tp=2 pp=2 cp=1",
        "dp_replicate=1 dp_shard=1 tp=4 pp=1 cp=1",
    ]
    assert [(sweep.label(s), r.split(";")[0]) for s, r in invalid] == [
        (
            "dp_replicate=1 dp_shard=? tp=4 pp=2 cp=1",
            "parallelism degrees dp_replicate x cp x tp x pp = 8 do not divide the world size 4",
        )
    ]


def test_enumeration_8_gpus_reports_invalid_shapes_with_reasons():
    valid, invalid = sweep.plan(DEBUG, {}, sweep.parse_grid("tp=1,2,4,8 pp=1,2,8"), 8)
    assert labels(valid) == [
        "dp_replicate=1 dp_shard=8 tp=1 pp=1 cp=1",
        "dp_replicate=1 dp_shard=4 tp=1 pp=2 cp=1",
        "dp_replicate=1 dp_shard=4 tp=2 pp=1 cp=1",
        "dp_replicate=1 dp_shard=2 tp=2 pp=2 cp=1",
        "dp_replicate=1 dp_shard=2 tp=4 pp=1 cp=1",
        "dp_replicate=1 dp_shard=1 tp=4 pp=2 cp=1",
    ]
    reasons = {sweep.label(s): r for s, r in invalid}
    assert (
        "must divide the attention heads (8) and KV heads (4)"
        in reasons["dp_replicate=1 dp_shard=1 tp=8 pp=1 cp=1"]
    )
    assert "exceeds the model's 4 layers" in reasons["dp_replicate=1 dp_shard=1 tp=1 pp=8 cp=1"]
    assert "do not divide the world size 8" in reasons["dp_replicate=1 dp_shard=? tp=8 pp=2 cp=1"]
    assert len(valid) + len(invalid) == 4 * 3


def test_extras_replicate_and_duplicate_runs():
    grid = sweep.parse_grid("dp_replicate=1,4 tp=1,2 reshard=always,never")
    valid, invalid = sweep.plan(DEBUG, {}, grid, 4)
    assert labels(valid) == [
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1 reshard=always",
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1 reshard=never",
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1 reshard=always",
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1 reshard=never",
        "dp_replicate=4 dp_shard=1 tp=1 pp=1 cp=1 reshard=always",
    ]
    # Without FSDP (plain DDP) the reshard mode changes nothing: the second is the same run, listed with why.
    reasons = {sweep.label(shape): reason for shape, reason in invalid}
    dup = reasons["dp_replicate=4 dp_shard=1 tp=1 pp=1 cp=1 reshard=never"]
    assert "same run as dp_replicate=4 dp_shard=1 tp=1 pp=1 cp=1 reshard=always" in dup
    assert sweep.settings_of(valid[-1]) == {
        "parallelism.dp_replicate": "4",
        "parallelism.dp_shard": "1",
        "parallelism.tp": "1",
        "parallelism.pp": "1",
        "parallelism.cp": "1",
        "parallelism.fsdp_reshard_after_forward": "always",
    }


def test_expert_parallel_is_a_dimension_for_llama4_and_refused_for_dense():
    moe = {"model.flavor": "llama4_debug"}
    valid, invalid = sweep.plan(DEBUG, moe, sweep.parse_grid("tp=1,2 ep=1,2,4"), 4)
    assert labels(valid) == [
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1 ep=1",
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1 ep=2",
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1 ep=4",
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1 ep=1",
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1 ep=2",
    ]
    [(shape, reason)] = invalid
    assert shape["ep"] == 4 and "must divide dp_shard = 2" in reason
    assert sweep.settings_of(valid[1])["parallelism.ep"] == "2" and sweep.name(valid[1]).endswith("-ep2")
    _, invalid = sweep.plan(DEBUG, {}, sweep.parse_grid("ep=2"), 2)
    assert "has no experts" in invalid[0][1]
    # the estimator counts the MoE layers: a verdict with figures
    ctx = SimpleNamespace(config=DEBUG, gpu_mem_gib=80.0)  # (what estimate_fit reads of a rush)
    est = rush_runner.estimate_fit(ctx, {**moe, **sweep.settings_of(valid[1])}, 4)
    assert est["total_gib"] > 0 and est["fits"] and "note" not in est


def test_ddp_with_tensor_parallel_is_reported_invalid():
    valid, invalid = sweep.plan(DEBUG, {}, sweep.parse_grid("dp_replicate=2 tp=2"), 4)
    assert not valid
    [(_, reason)] = invalid
    assert "does not compose with tensor parallel" in reason


def test_ac_and_batch_extras():
    valid, invalid = sweep.plan(DEBUG, {}, sweep.parse_grid("tp=1,2 ac=none,full batch=1,2"), 2)
    assert len(valid) == 8 and not invalid
    assert labels(valid)[:3] == [
        "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1 ac=none batch=1",
        "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1 ac=none batch=2",
        "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1 ac=full batch=1",
    ]
    assert sweep.name(valid[2]) == "rep1-shard2-tp1-pp1-cp1-ac_full-batch1"
    assert sweep.settings_of(valid[2])["activation_checkpoint.mode"] == "full"
    assert sweep.settings_of(valid[2])["training.local_batch_size"] == "1"


def test_seq_len_and_cp_validation():
    grid, seq12 = sweep.parse_grid("tp=1,2 cp=1,2"), {"training.seq_len": "12"}
    valid, invalid = sweep.plan(DEBUG, seq12, grid, 4)
    assert labels(valid) == [
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1",
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1",
    ]
    reasons = {sweep.label(s): r for s, r in invalid}
    # On this CPU machine the trainer refuses cp > 1; assume_cuda validates as on a GPU machine.
    assert "cp > 1 needs CUDA" in reasons["dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=2"]
    seq_error = "training.seq_len = 12 must be divisible by 2 x cp x tp = 8"
    assert seq_error in reasons["dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=2"]
    valid, invalid = sweep.plan(DEBUG, seq12, grid, 4, assume_cuda=True)
    assert "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=2" in labels(valid)
    assert [r for _, r in invalid] == [reasons["dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=2"]]


# ----------------------------------------------------------------------------------------------
# Dry run


def test_dry_run_prints_exactly_the_valid_shapes(fake_cpu, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["--config", DEBUG, "--ngpu", "4", "--grid", "tp=1,2,4 pp=1,2", "--dry-run", "--output", str(out)]
    assert sweep.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == (
        "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1\n"
        "dp_replicate=1 dp_shard=2 tp=1 pp=2 cp=1\n"
        "dp_replicate=1 dp_shard=2 tp=2 pp=1 cp=1\n"
        "dp_replicate=1 dp_shard=1 tp=2 pp=2 cp=1\n"
        "dp_replicate=1 dp_shard=1 tp=4 pp=1 cp=1\n"
    )
    assert "invalid: dp_replicate=1 dp_shard=? tp=4 pp=2 cp=1: parallelism degrees" in captured.err
    assert "5 valid shapes, 1 invalid" in captured.err
    assert not out.exists()

    argv = [
        "--config",
        DEBUG,
        "--ngpu",
        "2",
        "--grid",
        "tp=2 reshard=never ac=selective batch=2",
        "--dry-run",
    ]
    assert sweep.main(argv) == 0
    assert (
        capsys.readouterr().out
        == "dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1 reshard=never ac=selective batch=2\n"
    )


def test_dry_run_with_no_valid_shape_exits_1(fake_cpu, capsys):
    assert sweep.main(["--config", DEBUG, "--ngpu", "8", "--grid", "tp=8", "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "must divide the attention heads" in captured.err


# ----------------------------------------------------------------------------------------------
# A fake OOM: recorded as such, and the sweep goes on


def fake_child(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> tuple[int, bool]:
    """tp=2 runs out of memory; the others write a metrics.jsonl as the trainer does."""
    args = dict(zip(cmd, cmd[1:]))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if args["--parallelism.tp"] == "2":
        log_path.write_text(
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        )
        return 1, False
    run_dir = Path(args["--job.dump_folder"]) / args["--job.name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "step": s,
            "loss": 9.0,
            "tps": 1000.0 * s,
            "tflops": 1.0,
            "mfu": 40.0,
            "mem_active_gib": 3.0,
            "mem_reserved_gib": 4.0,
            "step_time": 0.5,
        }
        for s in (1, 2, 3)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    log_path.write_text("step 3 loss 9.0\n")
    return 0, False


def test_fake_oom_is_recorded_and_the_sweep_goes_on(fake_cpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(rush_runner, "run_child", fake_child)
    out = tmp_path / "sweep"
    argv = [
        "--config",
        DEBUG,
        "--ngpu",
        "2",
        "--grid",
        "tp=2,1,4",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--output",
        str(out),
        *TINY,
    ]
    assert sweep.main(argv) == 0
    rows = {r["shape"]: r for r in read_rows(out)}
    ok, oom = (
        rows["dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1"],
        rows["dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1"],
    )
    assert oom["status"] == OOM and oom["reason"].startswith("torch.OutOfMemoryError")
    assert ok["status"] == OK and ok["tps"] == pytest.approx(2500.0) and ok["mfu"] == 40.0
    assert ok["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1}
    assert ok["overrides"]["parallelism.dp_shard"] == "2" and "training.seq_len" not in ok["overrides"]
    assert ok["base_overrides"] == TINY and "NGPU=2 ./run_train.sh" in ok["command"]
    assert "--training.seq_len 64" in ok["command"] and ok["env"]["device"] == "cpu"
    bad = rows["dp_replicate=1 dp_shard=? tp=4 pp=1 cp=1"]
    assert bad["status"] == sweep.INVALID and "do not divide the world size 2" in bad["reason"]
    # rush dist takes the fastest OK shape's mesh, without the sweep's own overrides.
    assert rush.read_sweep_best(str(out / "results.jsonl")) == {
        "parallelism.dp_replicate": "1",
        "parallelism.dp_shard": "2",
        "parallelism.tp": "1",
        "parallelism.pp": "1",
        "parallelism.cp": "1",
    }
    md = (out / "results.md").read_text()
    assert md.index("| 1 | `dp_replicate=1 dp_shard=2 tp=1") < md.index(
        "| - | `dp_replicate=1 dp_shard=1 tp=2"
    )
    assert "**OOM**" in md and "do not divide the world size 2" in md
    printed = capsys.readouterr().out
    assert "[1/2] dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1 ... OOM (torch.OutOfMemoryError" in printed
    assert "[2/2] dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1 ... ok 2,500 tok/s/GPU, MFU 40.0%" in printed


def test_a_second_sweep_into_the_same_output_is_refused_before_any_run(
    fake_cpu, monkeypatch, tmp_path, capsys
):
    ran: list[list[str]] = []

    def counting_child(cmd, env, log_path, timeout_s):
        ran.append(cmd)
        return fake_child(cmd, env, log_path, timeout_s)

    def argv(output: Path) -> list[str]:
        return [
            "--config",
            DEBUG,
            "--ngpu",
            "2",
            "--grid",
            "tp=1",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--output",
            str(output),
            *TINY,
        ]

    monkeypatch.setattr(rush_runner, "run_child", counting_child)
    out = tmp_path / "sweep"
    assert sweep.main(argv(out)) == 0 and len(ran) == 1
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert sweep.main(argv(out)) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"titanrush sweep: --output {out} already holds results.jsonl, runs/ and logs/ of an earlier run, "
        "which this one would replace: choose another --output (or move that folder away first)"
    )
    assert len(ran) == 1  # nothing ran
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == first
    assert sweep.main([*argv(out), "--dry-run"]) == 0  # a dry run writes nothing: it may look at the folder
    assert sweep.main(argv(tmp_path / "again")) == 0 and len(ran) == 2


@pytest.mark.parametrize("warmup", ["-1", "-10"])
def test_a_negative_warmup_is_refused(fake_cpu, tmp_path, capsys, warmup):
    argv = [
        "--config",
        DEBUG,
        "--ngpu",
        "1",
        "--steps",
        "3",
        "--warmup",
        warmup,
        "--output",
        str(tmp_path / "s"),
    ]
    assert sweep.main(argv) == 2
    assert capsys.readouterr().err.strip() == "titanrush sweep: --warmup must be >= 0"
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------------------------
# A real sweep: 2 gloo processes under torchrun, FSDP2 and TP2 on the debug model


@pytest.mark.parallel
def test_cpu_sweep_end_to_end(tmp_path):
    out = tmp_path / "sweep"
    argv = [
        "--config",
        DEBUG,
        "--ngpu",
        "2",
        "--grid",
        "tp=1,2",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--output",
        str(out),
        *TINY,
    ]
    assert sweep.main(argv) == 0
    rows = read_rows(out)
    assert [r["shape"] for r in rows] == [
        "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1",
        "dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1",
    ]
    for r in rows:
        assert r["status"] == OK, (r["shape"], r.get("reason"), r.get("log"))
        assert r["tps"] > 0 and r["mem_active_gib"] > 0 and r["tps_total"] == pytest.approx(2 * r["tps"])
    best = max(rows, key=lambda r: r["tps"])
    assert rush.read_sweep_best(str(out / "results.jsonl"))["parallelism.tp"] == str(best["tp"])
    assert "| 1 | `" + best["shape"] + "` | ok |" in (out / "results.md").read_text()
    assert (out / "sweep.png").read_bytes()[:8] == PNG_MAGIC

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(p for p in (out / "tb").iterdir() if p.is_dir())
    assert [p.name for p in runs] == sorted(r["name"] for r in rows)
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    assert "sweep/tps" in acc.Tags()["scalars"]


def fake_estimate(cfg: Any, ngpu: int, gpu_mem_gib: float) -> Any:
    """100 GiB over tp: tp=1 needs 100 GiB, tp=2 50."""
    total = 100.0 / cfg.parallelism.tp
    return type("Est", (), {"total_gib": total, "fits": total <= gpu_mem_gib})()


def test_dry_run_flags_and_skips_what_the_estimator_says_will_not_fit(fake_cpu, monkeypatch, capsys):
    monkeypatch.setattr(rush_runner, "quick_estimate", fake_estimate)
    argv = ["--config", DEBUG, "--ngpu", "2", "--grid", "tp=1,2", "--dry-run", "--gpu-mem", "60"]
    assert sweep.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1",
        "dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1",
    ]
    assert "GPU memory: 60 GiB per GPU (--gpu-mem)" in captured.err
    assert "estimate: dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1: 100.0 of 60 GiB: does not fit" in captured.err
    assert "estimate: dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1: 50.0 of 60 GiB: fits" in captured.err
    assert sweep.main([*argv, "--skip-unfit"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1\n"
    assert "100.0 of 60 GiB: does not fit (skipped: --skip-unfit)" in captured.err
    # Nothing would run: exit 1, as when no shape is valid.
    assert sweep.main([*argv[:-1], "40", "--skip-unfit"]) == 1
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "device, extra, rule",
    [
        # A CPU machine: its host RAM (64 GiB in FAKE_CPU) says nothing about the GPUs: 80 GiB, said so.
        # (--assume-cuda: the 8B needs GPUs, which this machine has not: planned as on them)
        (
            FAKE_CPU,
            ["--assume-cuda"],
            ("assuming 80 GiB per GPU (no CUDA device here; pass --gpu-mem)", 80.0),
        ),
        (FAKE_CPU, ["--assume-cuda", "--gpu-mem", "141"], ("141 GiB per GPU (--gpu-mem)", 141.0)),
        (
            {**FAKE_CPU, "cuda": True, "name": "NVIDIA H200", "count": 4, "mem_gib": 139.8},
            [],
            ("139.8 GiB per GPU (this machine's NVIDIA H200", 139.8),
        ),
    ],
)
def test_dry_run_holds_every_shape_against_the_one_gpu_memory_rule(monkeypatch, capsys, device, extra, rule):
    """The 8B on 4 GPUs, with the real estimator: the same figure for every shape, the rule stated."""
    monkeypatch.setattr(rush_runner, "probe_device", lambda: dict(device))
    config = str(ROOT / "train_configs" / "llama8b_fsdp.toml")
    assert sweep.main(["--config", config, "--ngpu", "4", "--grid", "tp=1,2", "--dry-run", *extra]) == 0
    err = capsys.readouterr().err
    text, gib = rule
    assert f"GPU memory: {text}" in err
    verdicts = [line for line in err.splitlines() if line.startswith("estimate: ")]
    assert len(verdicts) == 2 and all(f" of {gib:g} GiB: " in line for line in verdicts), verdicts
    # Each verdict is estimate()'s own against that memory.
    cfg = cfgmod.load(config, ["--parallelism.tp", "1"])
    est = estimate(cfg, 4, gib, trace=False)
    verdict = "fits" if est.fits else "does not fit"
    assert f"tp=1 pp=1 cp=1: {est.total_gib:.1f} of {gib:g} GiB: {verdict}" in verdicts[0]


@pytest.mark.parametrize("flag", ["--config", "--output", "--steps"])
def test_an_option_without_its_value_is_named_not_replaced_by_a_default(tmp_path, capsys, flag):
    assert sweep.main(["--ngpu", "1", "--output", str(tmp_path / "out"), flag]) == 2
    assert f"argument {flag}: expected one argument" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


EIGHT_B = str(ROOT / "train_configs" / "llama8b_fsdp.toml")


def dry_run_report(err: str) -> tuple[list[str], list[str]]:
    """(the commands a dry run prints, its ranked shapes, best first)."""
    commands = [line[4:] for line in err.splitlines() if line.startswith("  $ ")]
    ranked = err[err.index("ranked before measuring") :].splitlines()[1:]
    return commands, [line.split(". ", 1)[1].split("  (")[0] for line in ranked if line.startswith("  ")]


def test_dry_run_prints_the_commands_it_would_run_and_ranks_the_shapes(
    fake_cpu, monkeypatch, tmp_path, capsys
):
    """Each valid shape's command, the very one the sweep runs; the shapes the estimator says fit ranked
    first (here tp=2: 50 of 60 GiB), then by the fewest GPUs in tp x pp x cp."""
    monkeypatch.setattr(rush_runner, "quick_estimate", fake_estimate)
    monkeypatch.setattr(rush_runner, "run_child", fake_child)
    argv = ["--config", DEBUG, "--ngpu", "2", "--grid", "tp=1,2", "--steps", "3", "--warmup", "1"]
    argv += ["--gpu-mem", "60", "--output", str(tmp_path / "sweep"), *TINY]
    assert sweep.main([*argv, "--dry-run"]) == 0
    captured = capsys.readouterr()
    commands, ranked = dry_run_report(captured.err)
    tp1, tp2 = "dp_replicate=1 dp_shard=2 tp=1 pp=1 cp=1", "dp_replicate=1 dp_shard=1 tp=2 pp=1 cp=1"
    assert captured.out.splitlines() == [tp1, tp2] and ranked == [tp2, tp1]
    assert sweep.main(argv) == 0  # the sweep itself: the same commands, in the same order
    rows = read_rows(tmp_path / "sweep")
    assert commands == [row["command"] for row in rows if row["status"] != sweep.INVALID]

    # Every shape fits 141 GiB: the fewest model-parallel GPUs first (FSDP alone), the most last.
    grid = ["--grid", "tp=2,1 pp=1,2", "--dry-run", "--assume-cuda", "--gpu-mem", "141"]
    assert sweep.main(["--config", EIGHT_B, "--ngpu", "4", *grid]) == 0
    _, ranked = dry_run_report(capsys.readouterr().err)
    assert ranked[0] == "dp_replicate=1 dp_shard=4 tp=1 pp=1 cp=1" and ranked[-1].endswith("tp=2 pp=2 cp=1")


@pytest.mark.parametrize("config, flavor", [(DEBUG, "debug"), (EIGHT_B, "8B")])
def test_results_md_gives_the_command_that_trains_this_config_with_the_best_shape(
    monkeypatch, tmp_path, config, flavor
):
    """The best shape trains *this* config (the command is in results.md); the rush's 8B run is offered
    only for a sweep of the 8B (on GPUs: here it would be refused)."""
    device = FAKE_CPU if flavor == "debug" else {**FAKE_CPU, "cuda": True, "name": "H200", "count": 2}
    monkeypatch.setattr(rush_runner, "probe_device", lambda: dict(device))
    monkeypatch.setattr(rush_runner, "run_child", fake_child)
    out = tmp_path / "sweep"
    argv = ["--config", config, "--ngpu", "2", "--grid", "tp=1,2", "--steps", "3", "--warmup", "1"]
    assert sweep.main([*argv, "--output", str(out), *TINY]) == 0
    md = (out / "results.md").read_text()
    mesh = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1}
    best = " ".join(f"--parallelism.{d} {v}" for d, v in mesh.items())
    train = f"NGPU=2 ./run_train.sh --config {config} {' '.join(TINY)} {best}"
    assert f"trains this config with this mesh: `{train}`" in md
    assert ("runs the rush's 8B rung with this mesh" in md) == (flavor == "8B") and "runs the 8B" not in md
