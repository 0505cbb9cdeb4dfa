"""scripts/bench/side_by_side.py: valid config flags, one run at a time, the ratio table."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import tomllib

from titanrush import config
from titanrush.tools.trace_analysis import trace_timeline

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import side_by_side as sbs  # noqa: E402

CASES = [(row, setting) for row in sbs.ROWS for setting in sbs.SETTINGS]


@pytest.mark.parametrize(("row", "setting"), CASES, ids=[f"{r}-{s}" for r, s in CASES])
def test_every_setting_of_every_row_is_a_valid_config(row, setting, tmp_path):
    r = sbs.ROWS[row]
    flags = [*sbs.row_flags(r), *sbs.setting_flags(r)[setting]]
    cfg = config.load(None, flags)  # a removed or renamed key raises ConfigError here
    # ... and it is the work torchtitan's config for the row describes
    tt = tomllib.loads(sbs.torchtitan_toml(r, 10, tmp_path, tmp_path, tmp_path))
    assert (cfg.model.flavor, cfg.training.seq_len) == (tt["model"]["flavor"], tt["training"]["seq_len"])
    assert cfg.training.local_batch_size == tt["training"]["local_batch_size"]
    p, tp = cfg.parallelism, tt["parallelism"]
    assert (p.tp, p.cp, p.pp, p.ep) == (
        tp["tensor_parallel_degree"],
        tp["context_parallel_degree"],
        tp["pipeline_parallel_degree"],
        tp["expert_parallel_degree"],
    )
    assert cfg.float8.enable == (tt["model"]["converters"] == ["quantize.linear.float8"])
    assert cfg.experimental.async_tp == tp["enable_async_tensor_parallel"] == r.async_tp
    assert cfg.compile.enable and cfg.training.precision == "bf16"
    # `same` steps torch's fused AdamW after its own clip pass, as torchtitan; the others titanrush's default
    assert cfg.optimizer.implementation == ("fused" if setting == "same" else "fused_clip")
    assert cfg.model.tie_embeddings in ("untied", "flavor") and cfg.model.attn_backend == "sdpa"
    if p.pp > 1:  # torchtitan's micro-batches of one sequence
        assert p.pp_microbatches == r.batch // tp["pipeline_parallel_microbatch_size"]
    ac = cfg.activation_checkpoint
    if setting == "same":  # torchtitan's AC policy: per-op, every other matmul output kept
        assert ac.mode == tt["activation_checkpoint"]["mode"]
        assert ac.mode == "none" or (ac.selective, ac.op_matmuls) == ("op", "alternate")


@pytest.mark.parametrize("balance", [False, True])
def test_balance_sets_the_same_warmup_and_bias_step_in_both_trainers_on_llama4_rows_only(balance, tmp_path):
    argv = ["--out", str(tmp_path), "--rows", "moe_ep2,1b", "--settings", "same", *(["--balance"] * balance)]
    a = sbs.parse_args(argv)
    runs = {
        (r.trainer, r.row): r
        for r in sbs.plan([sbs.ROWS["moe_ep2"], sbs.ROWS["1b"]], a.settings, a, tmp_path)
    }
    for row, balanced in (("moe_ep2", balance), ("1b", False)):
        cfg = config.load(None, runs["titanrush", row].cmd[1:])
        tt = tomllib.loads((tmp_path / "configs" / f"torchtitan_{row}.toml").read_text())
        warmup = 100 if balanced else 10
        assert cfg.lr_scheduler.warmup_steps == tt["lr_scheduler"]["warmup_steps"] == warmup
        rate = 1e-2 if balanced else 1e-3
        assert float(runs["torchtitan", row].env["TT_LOAD_BALANCE_COEFF"]) == rate
        if row == "moe_ep2":  # torchtitan 0.2.2 has no balance loss
            assert (cfg.moe.bias_update_rate, cfg.moe.aux_loss_coeff) == (rate, 0.0)


def test_balance_with_the_defaults_keeps_titanrushs_balance_loss(tmp_path):
    """Each trainer's balancing settings: both warm up over 100 steps at bias step 1e-2, and titanrush
    keeps its shipped balance loss (torchtitan 0.2.2 has none)."""
    a = sbs.parse_args(["--out", str(tmp_path), "--rows", "moe", "--settings", "defaults", "--balance"])
    runs = {r.trainer: r for r in sbs.plan([sbs.ROWS["moe"]], a.settings, a, tmp_path)}
    cfg = config.load(None, runs["titanrush"].cmd[1:])
    tt = tomllib.loads((tmp_path / "configs" / "torchtitan_moe.toml").read_text())
    assert cfg.lr_scheduler.warmup_steps == tt["lr_scheduler"]["warmup_steps"] == 100
    assert cfg.moe.bias_update_rate == float(runs["torchtitan"].env["TT_LOAD_BALANCE_COEFF"]) == 1e-2
    shipped = config.JobConfig().moe.aux_loss_coeff
    assert shipped > 0 and cfg.moe.aux_loss_coeff == shipped


def test_llama4_rows_route_as_torchtitan_only_in_the_same_setting(tmp_path):
    a = sbs.parse_args(["--out", str(tmp_path), "--rows", "moe", "--settings", "same,defaults"])
    runs = {
        r.setting: r for r in sbs.plan([sbs.ROWS["moe"]], a.settings, a, tmp_path) if r.trainer == "titanrush"
    }
    same = config.load(None, runs["same"].cmd[1:]).moe
    defaults = config.load(None, runs["defaults"].cmd[1:]).moe
    assert (same.bias_update_rate, same.aux_loss_coeff) == (1e-3, 0.0)
    shipped = config.JobConfig().moe
    assert defaults.bias_update_rate == shipped.bias_update_rate
    assert defaults.aux_loss_coeff == shipped.aux_loss_coeff
    assert shipped.aux_loss_coeff > 0  # (else the two settings are the same run)


def test_profiled_steps_are_left_out_of_the_figures():
    run = sbs.Run("titanrush", "1b", "same", ["x"], {}, sbs.ROOT, sbs.ROOT / "log")
    # both profilers slow the profiled steps (5, 10), their warm-up steps and the steps that write the traces
    slow = {4, 5, 6, 9, 10, 11}
    steps = [{"step": i, "tps": 10.0 if i in slow else 100.0, "mem_gib": 1, "loss": 1} for i in range(1, 13)]
    out = sbs.summarize(run, {"status": "ok", "steps": steps}, 3, profile_step=5)
    assert out["tps"] == 100.0 and len(out["loss_curve"]) == 12  # the slow steps left out; curves whole
    every = sbs.summarize(run, {"status": "ok", "steps": steps}, 3)  # steps 3-12: 6 slow, 4 fast
    assert every["tps"] == pytest.approx((6 * 10 + 4 * 100) / 10)


def test_the_loss_curve_holds_each_logged_steps_own_loss_as_torchtitan_logs_it():
    """titanrush's `loss` is the mean since the previous logged step; `(last ...)` is the step's own."""
    line = "10:31:32 INFO step     10  loss 9.5000  (last 9.2637)  gnorm 1.779  lr 2.19e-04  tps 338"
    step = sbs.parse_step("titanrush", line)
    assert (step["loss"], step["loss_last"]) == (9.5, 9.2637)
    run = sbs.Run("titanrush", "1b", "same", ["x"], {}, sbs.ROOT, sbs.ROOT / "log")
    assert sbs.summarize(run, {"status": "ok", "steps": [step]}, 1)["loss_curve"] == [[10, 9.2637]]


def test_a_logged_line_counts_for_the_steps_since_the_line_before_it():
    """Logging every 10 steps: the line at step 10 stands for steps 2-10 (compile warm-up), left out when
    measuring from 11; lines count for their number of steps (step 1's: one)."""
    run = sbs.Run("torchtitan", "1b", "-", ["x"], {}, sbs.ROOT, sbs.ROOT / "log")
    steps = [
        {"step": s, "tps": t, "mfu": t / 10, "mem_gib": m, "loss": 1.0}
        for s, t, m in ((1, 5.0, 1.0), (10, 20.0, 9.0), (20, 100.0, 3.0), (30, 70.0, 2.0))
    ]
    out = sbs.summarize(run, {"status": "ok", "steps": steps}, 11)
    assert out["tps"] == pytest.approx(85.0) and out["mfu"] == pytest.approx(8.5)
    assert out["mem_gib"] == 3.0 and len(out["loss_curve"]) == 4
    every = sbs.summarize(run, {"status": "ok", "steps": steps}, 1)
    assert every["tps"] == pytest.approx((5 + 9 * 20 + 10 * 100 + 10 * 70) / 30) and every["mem_gib"] == 9.0
    assert sbs.summarize(run, {"status": "ok", "steps": steps}, 12)["tps"] == 70.0  # 11-20 not all measured


def test_both_trainers_log_every_10_steps_unless_a_step_is_profiled(tmp_path):
    a = sbs.parse_args(["--out", str(tmp_path), "--rows", "8b_fsdp4", "--settings", "same"])
    runs = sbs.plan([sbs.ROWS["8b_fsdp4"]], a.settings, a, tmp_path)
    ours = config.load(None, next(r for r in runs if r.trainer == "titanrush").cmd[1:])
    tt = tomllib.loads((tmp_path / "configs" / "torchtitan_8b_fsdp4.toml").read_text())
    assert a.log_freq == ours.metrics.log_freq == tt["metrics"]["log_freq"] == 10  # torchtitan's default
    profiled = ["--out", str(tmp_path), "--steps", "20", "--profile-step", "12"]
    assert sbs.parse_args(profiled).log_freq == 1  # a logged line must not stand for the profiled steps
    with pytest.raises(SystemExit):
        sbs.parse_args([*profiled, "--log-freq", "10"])
    with pytest.raises(SystemExit):  # titanrush would log step 25, torchtitan not: other steps measured
        sbs.parse_args(["--out", str(tmp_path), "--steps", "25"])


def test_flags_go_to_each_titanrush_run_only(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "run_train.sh").touch()
    argv = [
        "--out",
        str(tmp_path),
        "--rows",
        "8b_tp2_fsdp2",
        "--flags=--experimental.async_tp",
        "--base",
        str(base),
        "--balance",
    ]
    a = sbs.parse_args(argv)
    runs = sbs.plan([sbs.ROWS["8b_tp2_fsdp2"]], a.settings, a, tmp_path)
    assert {r.trainer for r in runs} == {"torchtitan", "titanrush", "base"}
    for run in runs:  # (the base checkout may not know the flags)
        assert ("--experimental.async_tp" in run.cmd) == (run.trainer == "titanrush")
    assert all(config.load(None, r.cmd[1:]).experimental.async_tp for r in runs if r.trainer == "titanrush")
    assert sbs.BALANCE == ["--lr_scheduler.warmup_steps", "100", "--moe.bias_update_rate", "1e-2"]


def test_a_row_torchtitan_cannot_do_runs_titanrush_alone(tmp_path):
    a = sbs.parse_args(["--out", str(tmp_path), "--rows", "8b_tp2"])
    runs = sbs.plan([sbs.ROWS["8b_tp2"]], a.settings, a, tmp_path)
    assert runs and {r.trainer for r in runs} == {"titanrush"}


def test_same_splits_a_pipeline_as_torchtitan_does():
    """torchtitan 0.2.2 counts the embedding and the output as a layer each and spreads the units evenly,
    the first stages taking the remainder: 34 units over 2 stages, 17 + 17; over 4, 9 + 9 + 8 + 8."""
    assert sbs.even_split(sbs.ROWS["8b_pp2_fsdp2"]) == [16, 16]
    assert sbs.even_split(sbs.Row("x", "8B", 4, 8192, 4, pp=4)) == [8, 9, 8, 7]
    flags = sbs.setting_flags(sbs.ROWS["8b_pp2_fsdp2"])
    assert config.load(None, flags["same"]).parallelism.pp_layers_per_stage == [16, 16]
    assert config.load(None, flags["defaults"]).parallelism.pp_layers_per_stage == []  # titanrush's own


def test_window_imbalance_sums_each_experts_tokens_over_ten_steps(tmp_path):
    """Per 10-step window: the layer's max / mean of the summed load, worst and mean over layers."""
    rows = []
    for step in range(1, 21):
        first = step <= 10  # layer 0 alternates (even over the window), then sticks to expert 0
        l0 = ([4, 0] if step % 2 else [0, 4]) if first else [4, 0]
        rows.append({"step": step, "moe_tokens_l0": l0, "moe_tokens_l1": [3, 1] if first else [2, 2]})
    rows.insert(5, {"step": 5, "val_loss": 2.0})  # a validation record: no load
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 21, "moe_tok')  # torn last line
    # window 1: layer 0 [20, 20] -> 1.0, layer 1 [30, 10] -> 1.5; window 2: [40, 0] -> 2.0, [20, 20] -> 1.0
    assert sbs.window_imbalance(path) == [[10, 1.5, 1.25], [20, 2.0, 1.5]]
    assert sbs.window_imbalance(tmp_path / "missing.jsonl") == []


def test_a_stale_key_fails_the_check():
    with pytest.raises(config.ConfigError):
        config.load(None, [*sbs.row_flags(sbs.ROWS["1b"]), "--parallelism.no_such_key", "1"])


def test_dry_run_prints_one_command_per_run_in_order(tmp_path, capsys):
    base = tmp_path / "base"
    base.mkdir()
    (base / "run_train.sh").write_text("")
    rows = ["1b", "8b_fsdp4", "8b_pp2_fsdp2"]
    argv = ["--out", str(tmp_path / "out"), "--rows", ",".join(rows), "--base", str(base), "--dry-run"]
    assert sbs.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    tags = [line[1 : line.index("]")].split() for line in lines]
    expected = []
    for row in rows:
        expected.append(["torchtitan", row, "-"])
        # 1b has no AC: its best is its defaults, run once (`same` differs in the optimizer's kernel)
        for setting in ["same", "defaults"] if row == "1b" else ["same", "defaults", "best"]:
            expected += [["titanrush", row, setting], ["base", row, setting]]
    assert tags == expected
    for line, (trainer, row, _) in zip(lines, tags):
        cmd = line[line.index("]") + 2 :]
        launches = cmd.count("run_train.sh") + cmd.count("torchtitan.train")
        assert launches == 1 and "&" not in cmd.replace("&& ", "")  # one launch, nothing in the background
        ngpu = sbs.ROWS[row].ngpu
        assert f"NGPU={ngpu} " in cmd or f"--nproc_per_node={ngpu} " in cmd
        assert (f"cd {base} && " in cmd) == (trainer == "base")
    assert "--activation_checkpoint.op_matmuls alternate" in lines[6]  # 8b_fsdp4 same
    assert (tmp_path / "out" / "configs" / "torchtitan_8b_pp2_fsdp2.toml").exists()


def test_tt_ac_runs_torchtitan_once_per_ac_and_the_table_compares_with_shipped_and_best(tmp_path):
    """--tt-ac: torchtitan at each AC setting asked (its recipes' per-op is "as shipped"), each run in a
    folder of its own; titanrush's `auto` leaves every lever the planner picks to it."""
    a = sbs.parse_args(
        ["--out", str(tmp_path), "--rows", "1b", "--tt-ac", "row,op,full,none", "--settings", "auto"]
    )
    runs = sbs.plan([sbs.ROWS["1b"]], a.settings, a, tmp_path)
    tt = [r for r in runs if r.trainer == "torchtitan"]
    assert [r.setting for r in tt] == ["-", "ac op", "ac full"]  # (the row's own is none: run once)
    modes = [
        tomllib.loads((tmp_path / "configs" / f"torchtitan_{n}.toml").read_text())["activation_checkpoint"]
        for n in ("1b", "1b_acop", "1b_acfull")
    ]
    assert modes == [{"mode": "none"}, {"mode": "selective", "selective_ac_option": "op"}, {"mode": "full"}]
    assert len({r.log for r in tt}) == 3
    ours = config.load(None, next(r for r in runs if r.trainer == "titanrush").cmd[1:])
    assert (ours.activation_checkpoint.mode, ours.training.loss) == ("auto", "auto")
    assert ours.parallelism.fsdp_reshard_after_forward == "auto"
    with pytest.raises(SystemExit):
        sbs.parse_args(["--out", str(tmp_path), "--tt-ac", "selective"])

    def result(trainer: str, setting: str, tps: float) -> dict:
        return {"row": "1b", "trainer": trainer, "setting": setting, "status": "ok", "tps": tps}

    results = [result("torchtitan", "-", 1000), result("torchtitan", "ac op", 800)]
    results += [result("torchtitan", "ac full", 600), result("titanrush", "auto", 1100)]
    line = next(x for x in sbs.table(results).splitlines() if "| titanrush |" in x)
    assert line.startswith("| 1b | auto | titanrush | ok | 1,100 | 1.100x |")
    assert line.endswith("| 1.375x | 1.100x |")  # vs torchtitan as shipped (op), vs its best


FAKE = """
import sys, time
name, path, kind = sys.argv[1:4]
open(path, "a").write(f"{name} start {time.time()}\\n")
for step in range(1, 5):
    time.sleep(0.05)
    if kind == "torchtitan":
        print(f"[titan] INFO - step: {step}  loss: {8 - step / 4}  grad_norm: 1.0  "
              f"memory: {40 + step:.2f}GiB(30.00%)  tps: {1000 * step:,}  tflops: 1.00  mfu: {step}.00%")
    elif kind == "base":  # (a base checkout may print the line as titanrush did before)
        print(f"12:00:00 INFO step {step:>6}  loss {7 - step / 4:.4f}  gnorm 1.000  tps {1200 * step:,}  "
              f"tflops 1.0  mfu {step + 1:.1f}%  mem 1.00GiB  (1%)  reserved {30 + step:.2f}GiB  "
              f"experts max/mean {1 + step / 10:.2f}  step 0.050s")
    else:
        print(f"12:00:00 step {step}  loss {7 - step / 4:.4f}  lr 3.0e-04  gnorm 1.00  "
              f"tok/s {1200 * step:,}  mfu {step + 1:.1f}%  mem {30 + step:.1f}GiB (40%)  "
              f"busiest expert {1 + step / 10:.2f}x mean load")
open(path, "a").write(f"{name} end {time.time()}\\n")
"""


def test_runs_go_one_at_a_time_and_the_table_compares_with_torchtitan(tmp_path, monkeypatch):
    spans = tmp_path / "spans.txt"
    monkeypatch.setitem(sbs.ROWS, "fake", sbs.Row("fake", "debug", 0, 256, 1))

    def fake_plan(rows, names, a, work):
        return [
            sbs.Run(
                trainer,
                "fake",
                setting,
                [sys.executable, "-c", FAKE, f"{trainer}-{setting}", str(spans), trainer],
                {},
                tmp_path,
                work / f"{trainer}-{setting}.log",
            )
            for trainer, setting in (("torchtitan", "-"), ("titanrush", "same"), ("base", "same"))
        ]

    monkeypatch.setattr(sbs, "plan", fake_plan)
    monkeypatch.setattr(sbs, "write_hf_tokenizer", lambda folder: None)
    monkeypatch.setattr(sbs, "write_corpus", lambda path: None)
    out = tmp_path / "out"
    metrics = out / "runs" / "titanrush-same" / "metrics.jsonl"  # what the fake titanrush "wrote"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("".join(json.dumps({"step": i, "moe_tokens_l0": [3, 1]}) + "\n" for i in range(1, 5)))
    assert (
        sbs.main(
            ["--out", str(out), "--rows", "fake", "--steps", "4", "--measure-from", "3", "--log-freq", "1"]
        )
        == 0
    )
    events = [line.split() for line in spans.read_text().splitlines()]
    assert [e[1] for e in events] == ["start", "end"] * 3  # each run ended before the next began
    assert all(float(events[i][2]) <= float(events[i + 1][2]) for i in range(len(events) - 1))
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    tt, ours, base = results
    assert (tt["tps"], tt["mem_gib"], tt["mfu"]) == (3500, 44, 3.5)  # steps 3-4
    assert (ours["tps"], ours["mem_gib"], ours["mfu"]) == (4200, 34, 4.5)
    assert 0 < tt["first_step_s"] < 30 and base["status"] == "ok"
    # every logged step's loss, from either trainer's line format; titanrush's routing imbalance
    assert tt["loss_curve"] == [[step, 8 - step / 4] for step in range(1, 5)] and tt["imbalance_curve"] == []
    assert ours["loss_curve"] == [[step, 7 - step / 4] for step in range(1, 5)]
    assert ours["imbalance_curve"] == [[step, round(1 + step / 10, 2)] for step in range(1, 5)]
    assert ours["imbalance_windows"] == [[10, 1.5, 1.5]] and "imbalance_windows" not in tt  # metrics.jsonl
    table = (out / "results.md").read_text()
    assert "| fake | same | titanrush | ok | 4,200 | 1.200x | 34.0 | 4.5 |" in table
    assert "| fake | same | base | ok | 4,200 | 1.200x |" in table


def test_profile_step_profiles_that_step_in_both_trainers_and_tables_their_timelines(tmp_path):
    """--profile-step N: torchtitan's profiler records step N, titanrush's too (valid config keys); each
    run's rank-0 trace is found where the trainer writes it and its timeline lands in the table."""
    row = sbs.ROWS["8b_fsdp4"]
    tt = tomllib.loads(sbs.torchtitan_toml(row, 20, tmp_path, tmp_path, tmp_path, profile_step=12))
    prof = tt["profiling"]
    assert prof["enable_profiling"] and prof["profile_freq"] == 12 and prof["profiler_active"] == 1
    assert prof["profile_freq"] >= prof["profiler_active"] + prof["profiler_warmup"]  # torchtitan's rule
    assert prof["profiler_warmup"] == 1  # as titanrush's schedule: both pay the same warm-up steps
    a = sbs.parse_args(
        [
            "--out",
            str(tmp_path),
            "--rows",
            "8b_fsdp4",
            "--settings",
            "same",
            "--steps",
            "20",
            "--profile-step",
            "12",
        ]
    )
    runs = sbs.plan([row, sbs.ROWS["8b_cp2_fsdp2"]], a.settings, a, tmp_path)
    dumps = [
        tomllib.loads((tmp_path / "configs" / f"torchtitan_{r}.toml").read_text())["job"]["dump_folder"]
        for r in ("8b_fsdp4", "8b_cp2_fsdp2")
    ]
    assert dumps[0] != dumps[1]  # each row's torchtitan traces in a folder of its own
    ours = next(r for r in runs if r.trainer == "titanrush")
    flags = ours.cmd[1:]
    cfg = config.load(None, flags)
    assert (cfg.profiling.enable, cfg.profiling.freq, cfg.profiling.active_steps) == (True, 12, 1)
    with pytest.raises(SystemExit):
        sbs.parse_args(["--out", str(tmp_path), "--steps", "5", "--profile-step", "9"])
    with pytest.raises(SystemExit):  # warm-up, profiled and export steps would leave nothing to measure
        sbs.parse_args(["--out", str(tmp_path), "--steps", "9", "--profile-step", "3"])

    events = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 30},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 20, "dur": 20},
        ]
    }
    ours_trace = tmp_path / "runs" / ours.log.stem / "profile" / "step-12" / "rank0.trace.json.gz"
    theirs_trace = Path(dumps[0]) / "profile_traces" / "iteration_12" / "rank0_trace.json"
    for path, opener in ((ours_trace, gzip.open), (theirs_trace, open)):
        path.parent.mkdir(parents=True)
        with opener(path, "wt") as fh:
            json.dump(events, fh)
    theirs = next(r for r in runs if r.trainer == "torchtitan")
    assert sbs.trace_of(ours, tmp_path) == ours_trace and sbs.trace_of(theirs, tmp_path) == theirs_trace
    t = trace_timeline(ours_trace)
    assert t["step"] == pytest.approx(0.040) and t["exposed_comm"] == pytest.approx(0.010)
    result = {"row": "8b_fsdp4", "setting": "same", "trainer": "titanrush", "timeline": t}
    t["kernel_matmul"] = 12.0  # ms per step
    row = "| 8b_fsdp4 | same | titanrush | 0.0 | 0.0 (75%) | 0.0 (25%) | 0.0 (0%) | 0.0 (0%) | 0.0 |"
    assert row + " 12 / 0 / 0 / 0 |" in sbs.timeline_table([result])


def test_kernel_tables_set_each_titanrush_run_beside_its_rows_torchtitan_run():
    """Per titanrush run with kernels, a table of the kernels that differ most from the same row's
    torchtitan run, through JSON as results.jsonl holds them (tuples become lists); a row without a
    torchtitan profile gets none."""
    tt = {"aten::mm 8x4 @ 4x16": (2, 10.0), "rope_complex": (1, 3.0)}
    ours = {"aten::mm 8x4 @ 4x16": (2, 9.5), "rope_real": (1, 1.0)}
    rs = {
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": {
            "calls": 130,
            "ms": 43.5,
            "exposed": 5.0,
            "concurrent": 10.0,
        }
    }
    results = json.loads(
        json.dumps(
            [
                {
                    "row": "8b_fsdp4",
                    "setting": "-",
                    "trainer": "torchtitan",
                    "kernels": tt,
                    "collectives": rs,
                },
                {
                    "row": "8b_fsdp4",
                    "setting": "same",
                    "trainer": "titanrush",
                    "kernels": ours,
                    "collectives": {},
                },
                {"row": "1b", "setting": "same", "trainer": "titanrush", "kernels": ours},
            ]
        )
    )
    text = sbs.kernel_tables(results)
    assert text.count("| kernel | torchtitan ms |") == 1 and "8b_fsdp4, same:" in text and "1b" not in text
    lines = [line for line in text.splitlines() if line.startswith("| `")]
    assert lines[0] == "| `rope_complex` | 3.0 | 1 | 0.0 | 0 |"  # the largest gap first
    assert lines[1] == "| `rope_real` | 0.0 | 0 | 1.0 | 1 |"
    assert lines[2] == "| `aten::mm 8x4 @ 4x16` | 10.0 | 2 | 9.5 | 2 |"
    assert lines[3] == "| `ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL` | 130, 43.5, 5.0, 10.0 | - |"


def test_the_estimators_validation_script_predicts_what_estimate_says():
    """scripts/bench/validate_estimator.py (estimator_gpu.md's tables): its prediction for run_train.sh
    arguments is `titanrush estimate`'s for the same config, and its table shows the error against a
    measurement."""
    import validate_estimator as ve

    from titanrush.tools.estimate import estimate

    args = ["--model.flavor", "debug", "--training.seq_len", "256", "--training.local_batch_size", "4"]
    got = ve.predict(args, 2, 80.0, 1.0)
    est = estimate(config.load(None, args), 2, 80.0, moe_imbalance=1.0)
    assert got["pred_alloc"] == est.rank_peaks_gib[0] > 0
    assert got["pred_reserved"] == est.rank_peaks_gib[0] + est.rank_slack_gib[0]
    row = {"name": "debug", "ngpu": 2, "status": "ok", **got, "meas_alloc": got["pred_alloc"] * 1.25}
    row["meas_reserved"] = None
    assert "| debug | 2 | " in ve.table([row]) and "| -20.0% | " in ve.table([row])


def test_the_estimators_validation_script_says_why_a_run_failed(tmp_path, capsys):
    """A run that fails is named with its error line (it said only `failed (2)`)."""
    import validate_estimator as ve

    row = ve.measure("bad", ["--training.stepz", "1"], 1, 1, tmp_path)
    assert row["status"] == "config error (2)" and row["meas_alloc"] is None
    assert "unknown config key training.stepz; did you mean training.steps" in row["reason"]
    assert "bad: config error (exit status 2): unknown config key" in capsys.readouterr().err


def test_auto_against_torchtitans_settings_in_the_estimator():
    """scripts/bench/plan_vs_torchtitan.py (auto_plan.md): torchtitan's settings are told apart from
    titanrush-only levers, and on the 8B over two H200s the estimated speed-up of auto's plan over
    torchtitan's per-op checkpointing is the one measured there (1.110x) within 3%."""
    import plan_vs_torchtitan as pvt

    from titanrush.run import autoplan

    cfg = config.load(str(ROOT / "train_configs" / "llama8b_fsdp.toml"), ["--training.loss", "auto"])
    choice = autoplan.resolve(cfg, 2, 139.8, machine=False)
    labels = {c.label(): pvt.torchtitan_like(c) for c in choice.ranked}
    assert labels["AC op alternate; ZeRO-3 (default); plain loss"] == "per-op"
    assert labels["AC full; ZeRO-3 (default); plain loss"] == "full"
    assert labels["AC none; ZeRO-3 (default); plain loss"] == "none"
    assert labels["AC op all; ZeRO-2 (never); plain loss"] is None  # ZeRO-2 and op all: titanrush's
    assert labels["AC op alternate; ZeRO-3 (default); chunked loss"] is None
    row = pvt.compare("8B", 2, pvt.C8, 139.8)
    speedup = float(row.split("**")[1].rstrip("x"))
    assert abs(speedup / 1.110 - 1) <= 0.03, row
