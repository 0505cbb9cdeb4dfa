"""Pipeline stage planning: balanced splits, stage placement, explicit splits, pruned stages."""

from __future__ import annotations

import pytest
import torch

from titanrush import config
from titanrush.config import ConfigError
from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.pipeline import ModelView, prune_to_stage, stage_costs
from titanrush.parallel.pipeline import balanced_split, stage_ids, stages_per_rank
from titanrush.run.plan import build_plan


def stage_cost(sizes: list[int], embed: float, out: float) -> list[float]:
    last = len(sizes) - 1
    return [s + (embed if i == 0 else 0) + (out if i == last else 0) for i, s in enumerate(sizes)]


def brute_force_best(n_layers: int, n_stages: int, embed: float, out: float) -> float:
    import itertools

    best = float("inf")
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, n_layers))]
        best = min(best, max(stage_cost(sizes, embed, out)))
    return best


CASES = [(8, 2, 0.0, 0.0), (32, 4, 0.8, 2.4), (16, 8, 0.3, 3.0), (10, 3, 2.0, 0.0), (4, 4, 0.5, 0.5)]


@pytest.mark.parametrize("n_layers, n_stages, embed, out", CASES)
def test_balanced_split_is_optimal(n_layers, n_stages, embed, out):
    sizes = balanced_split(n_layers, n_stages, embed_cost=embed, output_cost=out)
    assert sum(sizes) == n_layers and min(sizes) >= 1 and len(sizes) == n_stages
    best = brute_force_best(n_layers, n_stages, embed, out)
    assert max(stage_cost(sizes, embed, out)) == pytest.approx(best)


def test_8b_split_gives_the_ends_fewer_layers():
    with torch.device("meta"):
        model = Llama(model_args("8B"))
    embed, out = stage_costs(model_args("8B"))
    assert out == pytest.approx(128256 * 4096 / sum(p.numel() for p in model.layers["0"].parameters()))
    sizes = balanced_split(32, 4, embed_cost=embed, output_cost=out)
    assert sizes[-1] < sizes[1] and sizes[0] <= sizes[1]


def test_stage_placement():
    assert stages_per_rank("1F1B", 0) == 1
    assert stages_per_rank("Interleaved1F1B", 0) == 2
    assert stage_ids("Interleaved1F1B", 1, 4, 2) == [1, 5]
    assert stage_ids("ZBVZeroBubble", 1, 4, 2) == [1, 6]


def _pp_plan(world: int, *over: str):
    base = ["--parallelism.pp", "2", "--model.tie_embeddings", "untied", "--training.local_batch_size", "4"]
    return build_plan(config.load(None, [*base, *over]), world)


def test_plan_resolves_the_pipeline():
    plan = _pp_plan(2, "--parallelism.pp_layers_per_stage", "1,3")
    assert plan.layers_per_stage == (1, 3) and list(plan.stage_layers(1)) == [1, 2, 3]
    plan = _pp_plan(2, "--parallelism.pp_schedule", "Interleaved1F1B")
    assert plan.stages_per_rank == 2 and plan.microbatches == 4 and plan.stage_ids(1) == [1, 3]
    assert plan.fsdp_plan.reshard == "never"  # pipelined stages keep their gathered weights until backward
    # A split in the config applies to pipelines only: without one the whole model is one stage.
    one = build_plan(config.load(None, ["--parallelism.pp_layers_per_stage", "1,3"]), 1)
    assert one.layers_per_stage == (4,) and list(one.stage_layers(0)) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "over, match",
    [
        (["--parallelism.pp_layers_per_stage", "2,2,0"], "pp_layers_per_stage"),
        (["--parallelism.pp_layers_per_stage", "1,2"], "pp_layers_per_stage"),
        (["--parallelism.pp_layers_per_stage", "0,4"], "pp_layers_per_stage"),
        (
            ["--parallelism.pp_schedule", "GPipe", "--parallelism.pp_stages_per_rank", "2"],
            "one stage per rank",
        ),
        (
            ["--parallelism.pp_schedule", "Interleaved1F1B", "--parallelism.pp_stages_per_rank", "4"],
            "need at least",
        ),
    ],
)
def test_bad_pipeline_settings_are_config_errors(over, match):
    with pytest.raises(ConfigError, match=match):
        _pp_plan(2, *over)


def test_pruned_stages_keep_full_names_and_cover_the_model():
    with torch.device("meta"):
        model = Llama(model_args("debug"))
    first = prune_to_stage(model, 0, 1, first=True, last=False)
    last = prune_to_stage(model, 1, 3, first=False, last=True)
    assert first.output is None and first.norm is None and list(first.layers) == ["0"]
    assert last.tok_embeddings is None and list(last.layers) == ["1", "2", "3"]
    view = ModelView([first, last])
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in model.named_parameters()]
