"""Mesh proposals (`titanrush.run.mesh`, `nearest`): where data parallel alone cannot fit (the 70B on one
node, the 405B), the verdict before the build and `titanrush estimate` name the fastest tp / pp / cp degrees
that fit, as flags to write into the config, and why; the cost model's mesh terms; the one nearest-plan
logic both use."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from titanrush import config
from titanrush.config import ConfigError
from titanrush.run import autoplan, memory_check, mesh, nearest, plan_cost
from titanrush.run.memory_fit import GIB
from titanrush.run.plan import build_plan
from titanrush.tools import estimate as est_mod
from titanrush.tools import sweep

ROOT = Path(__file__).resolve().parents[2]
LLAMA70B = str(ROOT / "train_configs" / "llama70b_2d.toml")
LLAMA8B = str(ROOT / "train_configs" / "llama8b_fsdp.toml")
DATA_PARALLEL = ["--parallelism.tp", "1"]  # (the shipped 70B config is tp 8 for 64+ GPUs)


def verdict(path: str, ngpu: int, *over: str) -> str:
    """The one line the run stops with before the build (planned for H200s from here: machine=False)."""
    cfg = config.load(path, ["--plan.gpu_mem_gib", "141", *over])
    with pytest.raises(ConfigError) as e:
        memory_check.plan_run(cfg, ngpu, machine=False)
    return str(e.value)


def flags_of(text: str, after: str) -> list[str]:
    """The flags that follow `after` in a verdict, up to the note in parentheses or the sentence's end."""
    rest = text[text.index(after) + len(after) :]
    return shlex.split(rest.split(" (")[0].split(";")[0].split(". ")[0])


def fits(path: str, ngpu: int, *over: str) -> bool:
    cfg = config.load(path, ["--plan.gpu_mem_gib", "141", *over])
    memory_check.plan_run(cfg, ngpu, machine=False)  # (raises where it does not fit)
    return True


def test_the_shapes_are_the_sweeps():
    """Every tp x pp x cp of N GPUs, dp_shard the rest: the sweep's default grid, tp within a node."""
    for n in (4, 8, 16):
        grid = sweep.candidates(sweep.parse_grid(sweep.default_grid(n)), {d: 1 for d in sweep.DEGREES})
        swept = {(s["tp"], s["pp"], s["cp"]) for s in grid if n % (s["tp"] * s["pp"] * s["cp"]) == 0}
        shapes = mesh.shapes(n)
        assert {(s["tp"], s["pp"], s["cp"]) for s in shapes} == {t for t in swept if t[0] <= 8}
        assert all(s["dp_shard"] * s["tp"] * s["pp"] * s["cp"] == n for s in shapes)


def test_the_cost_model_counts_what_the_mesh_adds():
    """Data parallel within a node adds nothing; tensor parallel's collectives grow with tp; the pipeline's
    bubble is (pp - 1) / micro-batches of the step."""

    def cost(*over: str) -> plan_cost.Cost:
        cfg = autoplan.stand_in(config.load(LLAMA8B, list(over)))
        return plan_cost.step_cost(build_plan(cfg, 8, machine=False))

    assert cost().mesh_s == 0.0
    tp2, tp8 = cost("--parallelism.tp", "2"), cost("--parallelism.tp", "8")
    assert 0 < tp2.mesh_s / tp2.compute_s < tp8.mesh_s / tp8.compute_s  # (local batch kept: less compute)
    pp2 = cost(
        "--parallelism.pp", "2", "--training.local_batch_size", "4", "--parallelism.pp_microbatches", "4"
    )
    assert pp2.mesh_s == pytest.approx(pp2.compute_s * 1 / 4, rel=0.05)  # (+ FSDP's gathers, hidden)


def test_70b_data_parallel_on_16_h200s_names_a_smaller_batch_and_the_fastest_mesh():
    """No lever fits the 70B with FSDP over 16 GPUs: the nearest plan is a smaller local batch, and the
    fastest mesh of the 16 GPUs that fits comes beside it, with why; written into the config, each fits."""
    text = verdict(LLAMA70B, 16, *DATA_PARALLEL)
    assert "the nearest plan that fits (" in text and "or the fastest mesh of these GPUs that fits" in text
    batch = flags_of(text, "the nearest plan that fits (")[2:]  # (past "132.6 GiB):")
    assert batch[:2] == ["--training.local_batch_size", "2"] and fits(LLAMA70B, 16, *DATA_PARALLEL, *batch)
    proposal = text[text.index("or the fastest mesh") :]
    flags = flags_of(proposal, "GiB): ")
    assert "--parallelism.tp" in flags and "--training.global_batch_size" in flags  # (the global batch kept)
    assert (
        "(at dp_shard=16 every plan needs " in proposal
        and "the fastest mesh of 16 GPUs that fits" in proposal
    )
    assert fits(LLAMA70B, 16, *DATA_PARALLEL, *flags)


def test_70b_on_one_8_gpu_node_fits_no_mesh_and_the_estimator_says_what_does(capsys):
    """The 70B's fp32 states and AdamW alone take 131 GiB per GPU on 8: no mesh of one node fits. The
    nearest is FSDP's CPU offload; the estimator's list adds the fewest GPUs that fit, with their mesh."""
    text = verdict(LLAMA70B, 8, *DATA_PARALLEL)
    assert "the nearest plan that fits" in text and "--plan.offload all" in text
    argv = ["--config", LLAMA70B, "--ngpu", "8", "--gpu-mem", "141", "--no-trace", *DATA_PARALLEL]
    assert est_mod.main([*argv, "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["would_fit"]
    assert [f["kind"] for f in found] == ["offload", "gpus"]
    gpus = found[1]
    assert gpus["flags"].startswith("--ngpu 16 ") and "--parallelism.tp" in gpus["flags"]
    assert gpus["note"].startswith("data parallel alone does not fit them; ")
    assert est_mod.main([*argv, *gpus["flags"].split()]) == 0


@pytest.mark.parametrize("ngpu", [16, 64])
def test_405b_proposes_a_mesh(ngpu):
    """The 405B (local batch 2): on 64 GPUs the nearest plan is a mesh of them (tp 8 with context
    parallel); on 16 none fits without offload, and more GPUs come with their mesh."""
    over = ["--model.flavor", "405B", *DATA_PARALLEL, "--training.local_batch_size", "2"]
    cfg = config.load(LLAMA70B, ["--plan.gpu_mem_gib", "141", *over])
    plan = build_plan(autoplan.stand_in(cfg), ngpu, machine=False)
    found = nearest.fixes(cfg, plan, 141 * 0.95 * GIB, machine=False, every=True)
    kinds = [f.kind for f in found]
    if ngpu == 64:
        assert kinds[0] == "mesh"
        text = verdict(LLAMA70B, 64, *over)
        assert "the nearest plan that fits, a mesh (" in text and "--parallelism.tp 8" in text
        assert fits(LLAMA70B, 64, *over, *flags_of(text, "GiB): "))
    else:
        assert "mesh" not in kinds and kinds[-1] == "gpus"
        more = found[-1]
        assert more.ngpu > 16 and more.settings["parallelism.tp"] > 1
        assert more.flags(cfg, 16).startswith(f"NGPU={more.ngpu} ")


def test_the_mesh_is_proposed_only_where_the_levers_cannot_fit():
    """Where a lever fits at the run's mesh, the verdict and the estimator name it and no mesh."""
    cfg = config.load(LLAMA8B, ["--plan.gpu_mem_gib", "80"])
    plan = build_plan(autoplan.stand_in(cfg), 4, machine=False)
    found = nearest.fixes(cfg, plan, 60 * GIB, machine=False, every=True)
    assert found[0].kind == "levers" and "mesh" not in [f.kind for f in found]


@pytest.mark.parametrize(
    "path, ngpu, over",
    [
        (LLAMA8B, 1, []),
        (LLAMA8B, 4, []),
        (LLAMA70B, 8, DATA_PARALLEL),
        (LLAMA8B, 8, ["--parallelism.tp", "2"]),
    ],
)
def test_the_floor_never_skips_a_plan_that_fits(path, ngpu, over):
    """The bound the search skips meshes and batches by is at most the least memory of the planner's own
    candidates (full checkpointing is not always the least: its slack and working set)."""
    cfg = config.load(path, [*over, "--training.loss", "auto"])
    floor = mesh.least_memory_floor(cfg, ngpu, machine=False, moe_imbalance=1.25)
    plain, _ = autoplan.candidates(cfg, ngpu, offload="none", machine=False)
    assert floor is not None and floor <= min(c.total for c in plain)
