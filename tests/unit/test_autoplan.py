"""The fastest plan that fits (`titanrush.run.autoplan`, `memory_check`): the auto levers chosen by the
analytic estimate and the cost model for a GPU memory, the run stopped before it is built when nothing
fits (naming the nearest plan that does), the resolved values written into the run's config.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from titanrush import config, train
from titanrush.config import ConfigError
from titanrush.run import autoplan, memory_check, nearest, plan_cost, validate
from titanrush.run.memory_fit import GIB
from titanrush.run.plan import build_plan
from titanrush.tools import estimate as est_mod

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug.toml")
LLAMA1B = str(ROOT / "train_configs" / "llama1b_single.toml")
LLAMA8B = str(ROOT / "train_configs" / "llama8b_fsdp.toml")
ALL_AUTO = ["--training.loss", "auto"]  # (the 8B config leaves checkpointing and reshard to the planner)
AC_ONLY = ["--parallelism.fsdp_reshard_after_forward", "default"]  # reshard and loss explicit


def choose(path: str, ngpu: int, gib: float | None, *over: str) -> autoplan.Choice:
    return autoplan.resolve(config.load(path, list(over)), ngpu, gib, f"{gib} GiB", machine=False)


@pytest.mark.parametrize(
    "path, ngpu, mems",
    [
        (LLAMA8B, 4, range(30, 200, 10)),
        (LLAMA8B, 8, range(20, 160, 10)),
        (LLAMA1B, 1, range(10, 100, 5)),
    ],
)
def test_more_memory_recomputes_less(path, ngpu, mems):
    """Checkpointing alone left to the planner: as the GPU grows it recomputes less (none in the end);
    every lever left to it: the chosen plan never costs more on a larger GPU, and always fits when any
    plan does."""
    over = ["--activation_checkpoint.mode", "auto"] + (AC_ONLY if path == LLAMA8B else [])
    shares = []
    for gib in mems:
        c = choose(path, ngpu, gib, *over)
        shares.append(plan_cost.recompute_share(c.plan))
        if any(x.total <= c.limit for x in c.ranked):
            assert c.chosen.total <= c.limit
    assert shares == sorted(shares, reverse=True), shares
    assert shares[0] > shares[-1] == 0.0  # (the smallest GPU recomputes something, the largest nothing)
    if path != LLAMA8B:
        return
    costs, modes = [], set()
    for gib in mems:
        c = choose(path, ngpu, gib, *ALL_AUTO)
        fits = [x for x in c.ranked if x.total <= c.limit]
        assert c.chosen is (fits[0] if fits else c.chosen)  # the cheapest that fits
        costs.append(c.chosen.cost.extra_s)
        modes.add(c.plan.ac.mode)
    assert costs == sorted(costs, reverse=True), costs
    assert {"full", "selective", "none"} <= modes


def test_the_8b_plan_on_h200s():
    """On 4 H200s the 8B needs no checkpointing and keeps its weights gathered (ZeRO-2); on 80 GiB GPUs
    it checkpoints per op and reshards."""
    big = choose(LLAMA8B, 4, 141.0)
    assert (big.plan.ac.mode, big.plan.fsdp_plan.reshard) == ("none", "never")
    small = choose(LLAMA8B, 4, 80.0)
    assert (small.plan.ac.mode, small.plan.ac.selective) == ("selective", "op")
    assert small.plan.fsdp_plan.reshard == "default" and small.chosen.total <= small.limit


def test_no_gpu_memory_takes_the_plan_that_computes_least():
    c = choose(LLAMA8B, 4, None, *ALL_AUTO)
    assert (c.plan.ac.mode, c.plan.fsdp_plan.reshard, c.plan.loss) == ("none", "never", "plain")
    assert c.chosen.cost.extra_s == 0.0 and "computes least" in c.note


def test_explicit_values_are_kept():
    """Only the auto levers change; the others stay as given, whatever memory they cost."""
    c = choose(LLAMA8B, 4, 60.0, "--activation_checkpoint.mode", "none")
    assert c.levers == ["parallelism.fsdp_reshard_after_forward"]
    assert set(c.chosen.settings) == {"parallelism.fsdp_reshard_after_forward"}
    assert c.plan.ac.mode == "none" and c.cfg.activation_checkpoint.mode == "none"
    assert c.plan.fsdp_plan.reshard == "default"  # (the least memory: nothing fits 57 GiB without AC)
    explicit = config.load(LLAMA8B, ["--activation_checkpoint.mode", "full", *AC_ONLY])
    none = autoplan.resolve(explicit, 4, 141.0, "", machine=False)
    assert none.chosen is None and none.cfg is explicit and none.report() == []


def test_every_candidate_is_the_plan_the_trainer_builds():
    """Each candidate's plan (the base plan with its per-feature plans replaced) is `build_plan`'s for the
    config with those values, pipelined or not, with every offload."""
    pipelined = ["--parallelism.pp", "2", "--model.tie_embeddings", "untied"]
    for over in ([], pipelined, ["--parallelism.fsdp_keep_gathered_last", "2"]):
        cfg = config.load(LLAMA8B, [*ALL_AUTO, "--plan.offload", "all", *over])
        plain, extra = autoplan.candidates(cfg, 4, offload="all", machine=False)
        assert len(plain) >= 20 and extra
        for c in [*plain, *extra[::7]]:
            assert build_plan(autoplan.with_settings(cfg, c.settings), 4, machine=False) == c.plan, c.label()


def test_moe_under_ep_weighs_per_op_checkpointing_by_parts():
    """Llama 4 with expert parallel: the per-op candidates are weighed too, each the plan the trainer builds
    (MoE blocks checkpointed by parts), with its own estimate and cost."""
    over = ["--model.flavor", "llama4_1Bx16E", "--parallelism.ep", "2", "--training.seq_len", "4096"]
    over += ["--training.local_batch_size", "2", "--training.precision", "bf16", "--compile.enable"]
    cfg = config.load(None, [*over, "--activation_checkpoint.mode", "auto"])
    plain, _ = autoplan.candidates(cfg, 2, offload="none", machine=False)
    op = [c for c in plain if c.plan.ac.mode == "selective" and c.plan.ac.selective == "op"]
    assert len(op) >= 3 and all(c.plan.moe_by_parts for c in op)
    for c in op:
        assert build_plan(autoplan.with_settings(cfg, c.settings), 2, machine=False) == c.plan, c.label()
    none = next(c for c in plain if c.plan.ac.mode == "none")
    assert all(
        c.cost.extra_s > none.cost.extra_s and c.total > none.total for c in op
    )  # (keeps the experts')


def test_offload_only_where_allowed_and_nothing_fits_without_it():
    tight = choose(LLAMA8B, 2, 80.0)  # (2 x 80 GiB: not even full checkpointing fits)
    assert not tight.chosen.offloads and tight.chosen.total > tight.limit
    allowed = choose(LLAMA8B, 2, 80.0, "--plan.offload", "all")
    assert allowed.chosen.offloads and allowed.chosen.total <= allowed.limit
    assert "without offload" in allowed.note
    roomy = choose(LLAMA8B, 4, 141.0, "--plan.offload", "all")
    assert not roomy.chosen.offloads


def test_cost_model_orders_the_policies():
    """Recomputation grows from none through the per-op policies to every N-th block and full; ZeRO-3's
    second all-gather and the chunked loss cost something, offload hidden behind compute nothing more."""
    plain, _ = autoplan.candidates(config.load(LLAMA8B, ALL_AUTO), 4, offload="none", machine=False)
    by_label = {c.label(): c.cost for c in plain}
    zero2 = "ZeRO-2 (never); plain loss"
    order = ["AC none", "AC op all", "AC op all but w3", "AC op alternate", "AC every 2nd block", "AC full"]
    recompute = [by_label[f"{ac}; {zero2}"].recompute_s for ac in order]
    assert recompute == sorted(recompute) and recompute[0] == 0.0 < recompute[1]
    assert by_label["AC none; ZeRO-3 (default); plain loss"].regather_s > 0
    assert by_label["AC none; ZeRO-2 (never); chunked loss"].loss_s > 0
    assert by_label[f"AC none; {zero2}"].extra_s == 0.0


def test_the_table_lists_the_chosen_plan_first():
    c = choose(LLAMA8B, 4, 80.0, *ALL_AUTO)
    lines = c.report()
    assert lines[0].startswith(
        "auto plan (activation_checkpoint.mode, parallelism.fsdp_reshard_after_forward"
    )
    assert "5% kept free: a plan must fit 76.0 GiB" in lines[0]
    rows = [line for line in lines if line.startswith(("  * ", "    ")) and "GiB" not in line[:8]][1:]
    assert rows[0].startswith("  * " + c.chosen.label()) and f"{c.chosen.gib:.1f}" in rows[0]
    assert 3 <= len(rows) <= 1 + autoplan.RUNNERS_UP
    assert not any(r.startswith("  * ") for r in rows[1:])
    assert lines[-1].startswith("resolved: activation_checkpoint.mode = ")


def test_estimate_shows_the_plan_it_estimates(capsys):
    """`titanrush estimate` with auto levers prints the planner's table, and estimates the chosen plan."""
    argv = ["--config", LLAMA8B, "--ngpu", "4", "--no-trace", "--plan.gpu_mem_gib", "80"]
    assert est_mod.main(argv) == 0
    out = capsys.readouterr().out
    c = autoplan.resolve(
        config.load(LLAMA8B, ["--plan.gpu_mem_gib", "80"]),
        4,
        80.0,
        "80 GiB per GPU (plan.gpu_mem_gib)",
        machine=False,
    )
    assert "\n".join(c.report()) in out
    est = est_mod.estimate(config.load(LLAMA8B), 4, 80.0, trace=False)
    assert est.fits and est.total_gib == pytest.approx(c.chosen.gib)
    assert est.auto_settings == c.chosen.settings
    # Its verdict is the run's: an auto plan must fit with plan.margin to spare.
    one = est_mod.estimate(config.load(LLAMA8B), 1, 141.0, trace=False)
    assert not one.fits and one.total_gib < 141.0
    assert any("titanrush train refuses this one" in n for n in one.notes)


def test_build_plan_refuses_an_unresolved_lever():
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode = 'auto' is chosen before the plan"):
        build_plan(config.load(LLAMA8B), 4, machine=False)
    dims = build_plan(autoplan.stand_in(config.load(LLAMA8B)), 4, machine=False).dims
    assert dims.dp_shard == 4


@pytest.mark.parametrize(
    "over, named",
    [
        (["--activation_checkpoint.op_matmuls", "alternate"], "op_matmuls = 'alternate' is the planner's"),
        (["--activation_checkpoint.selective", "2"], "selective = '2' is the planner's choice"),
    ],
)
def test_auto_checkpointing_leaves_its_policy_keys_to_the_planner(over, named):
    with pytest.raises(ConfigError, match=named):
        validate.check_values(config.load(LLAMA8B, over))


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


def test_a_run_that_fits_nowhere_stops_before_the_build_with_the_nearest_plan(tmp_path, capsys):
    """`NGPU=1 ./run_train.sh --config llama8b_fsdp.toml` on a 141 GiB GPU (checked from here as on it:
    --assume-cuda): one line, exit 2, nothing built or written; the nearest plan that fits adds the
    chunked loss (a lever the config does not leave to the planner) to the least memory checkpointing."""
    assert train.main(check_args(tmp_path, LLAMA8B, "--assume-cuda", "--plan.gpu_mem_gib", "141")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("titanrush: config error: no plan of the auto levers fits the GPU with 5% to spare")
    assert (
        "\n" not in err
        and "is estimated at 137.2 GiB per GPU against 141 GiB per GPU (plan.gpu_mem_gib)" in err
    )
    assert "the nearest plan that fits (133.5 GiB): --training.loss chunked." in err
    assert "--plan.memory_check false" in err and not (tmp_path / "runs").exists()
    # Where no lever, batch or offload fits one GPU, the nearest plan takes two.
    one = config.load(LLAMA8B, ["--plan.gpu_mem_gib", "100", "--plan.offload", "all"])
    with pytest.raises(ConfigError, match=r"the nearest plan that fits \([0-9.]+ GiB\): NGPU=2 "):
        memory_check.plan_run(one, 1, machine=False)
    # An explicit plan that does not fit: the nearest plan changes the levers that keep the update.
    c = config.load(LLAMA8B, ["--activation_checkpoint.mode", "none", *AC_ONLY, "--plan.gpu_mem_gib", "100"])
    with pytest.raises(ConfigError) as e:
        memory_check.plan_run(c, 4, machine=False)
    text = str(e.value)
    assert text.startswith("the run does not fit the GPU: its plan (AC none; ZeRO-3 (default); plain loss)")
    assert "the nearest plan that fits" in text and "--activation_checkpoint.mode selective" in text
    [near] = nearest.fixes(c, build_plan(c, 4, machine=False), 95 * GIB, machine=False)
    assert near.kind == "levers" and near.found.total <= 95 * GIB and near.flags(c, 4) in text
    # plan.memory_check = false starts it anyway, with the plan that needs least memory.
    off = config.load(LLAMA8B, ["--plan.gpu_mem_gib", "141", "--plan.memory_check", "false"])
    assert "no plan fits" in memory_check.plan_run(off, 1, machine=False).note


def test_the_nearest_plan_may_be_a_smaller_batch_with_the_global_batch_kept():
    """... and where no lever fits at this mesh, the fastest mesh of these GPUs that fits is named beside
    it, the global batch kept."""
    c = config.load(LLAMA8B, ["--training.local_batch_size", "8", "--plan.gpu_mem_gib", "60"])
    with pytest.raises(ConfigError) as e:
        memory_check.plan_run(c, 4, machine=False)
    text = str(e.value)
    assert ": --training.local_batch_size 2 --training.global_batch_size 32; or the fastest mesh" in text
    mesh = text[text.index("the fastest mesh of these GPUs that fits") :]
    assert "--parallelism." in mesh and "--training.global_batch_size 32 " in mesh
    assert "(at dp_shard=4 every plan" in mesh


def test_check_prints_the_plan_it_would_run(tmp_path, capsys):
    over = ["--activation_checkpoint.mode", "auto", "--training.loss", "auto", "--plan.gpu_mem_gib", "1.1"]
    assert train.main(check_args(tmp_path, DEBUG, *over)) == 0
    out = capsys.readouterr().out
    c = autoplan.resolve(
        config.load(DEBUG, over), 1, 1.1, "1.1 GiB per GPU (plan.gpu_mem_gib)", machine=False
    )
    assert out == "\n".join([*c.report(), "config OK"]) + "\n"


def test_the_run_folder_holds_the_resolved_plan_and_a_rerun_is_the_same_run(tmp_path):
    """A debug run on CPU with every lever auto: config.toml holds the values chosen (no "auto"), and a run
    from that file makes the same plan."""
    over = [
        "--config",
        DEBUG,
        "--activation_checkpoint.mode",
        "auto",
        "--parallelism.fsdp_reshard_after_forward",
        "auto",
        "--training.loss",
        "auto",
        "--plan.gpu_mem_gib",
        "1.1",
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "run",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--no-metrics.tensorboard",
    ]
    assert train.main(over) == 0
    written = tmp_path / "run" / "config.toml"
    text = written.read_text()
    assert '"auto"' not in text
    first = memory_check.plan_run(config.load(DEBUG, over[2:]), 1)
    assert first.levers and first.chosen is not None
    values = config.read_toml(written)
    for key, value in first.chosen.settings.items():
        section, name = key.split(".")
        assert values[section][name] == value, key
    again = config.load(str(written))
    assert validate.auto_levers(again) == []
    assert memory_check.plan_run(again, 1).plan == first.plan
