"""ParallelDims: degree resolution, the checks of degrees and model fit (titanrush.run.validate through the
plan), and the mesh (on a fake process group)."""

from __future__ import annotations

import pytest

from titanrush import config
from titanrush.config import ConfigError
from titanrush.parallel.parallel_dims import ParallelDims
from titanrush.run.plan import build_plan


def dims(world: int, *, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, pp: int = 1):
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world)


@pytest.mark.parametrize(
    "world, given, shard",
    [
        (1, {}, 1),
        (8, {}, 8),
        (8, {"tp": 2}, 4),
        (8, {"dp_replicate": 2, "tp": 2}, 2),
        (16, {"pp": 2, "cp": 2, "tp": 2}, 2),
    ],
)
def test_dp_shard_minus_one_takes_what_is_left(world, given, shard):
    d = dims(world, **given)
    assert d.dp_shard == shard
    assert d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp == world


def plan(world: int, *args: str):
    return build_plan(config.load(None, list(args)), world)


def test_degrees_that_do_not_multiply_to_the_world_size_name_every_degree():
    with pytest.raises(
        ConfigError, match=r"dp_replicate\(1\) x dp_shard\(2\) x cp\(1\) x tp\(2\) x pp\(1\) = 4"
    ):
        plan(8, "--parallelism.dp_shard", "2", "--parallelism.tp", "2")
    with pytest.raises(ConfigError, match="dp_shard = -1"):
        plan(8, "--parallelism.dp_shard", "2", "--parallelism.tp", "2")


def test_degrees_that_do_not_divide_the_world_size():
    with pytest.raises(ConfigError, match="do not divide the world size 6"):
        plan(6, "--parallelism.tp", "4")


@pytest.mark.parametrize("key", ["dp_replicate", "cp", "tp", "pp"])
def test_degrees_below_one_are_refused(key):
    with pytest.raises(ConfigError, match=f"parallelism.{key} must be >= 1"):
        plan(4, f"--parallelism.{key}", "0")


def test_dp_shard_zero_is_refused():
    with pytest.raises(ConfigError, match="dp_shard must be -1"):
        plan(4, "--parallelism.dp_shard", "0")


def test_derived_degrees():
    d = dims(16, dp_replicate=2, tp=2, pp=2)
    assert (d.dp_shard, d.dp) == (2, 4)
    assert d.fsdp_enabled and not d.ddp_enabled
    ddp = dims(4, dp_replicate=4)
    assert ddp.dp_shard == 1 and ddp.ddp_enabled and not ddp.fsdp_enabled
    tp_only = dims(2, tp=2)
    assert tp_only.dp == 1 and not tp_only.fsdp_enabled and not tp_only.ddp_enabled
    assert dims(2, dp_shard=1, cp=2).fsdp_enabled  # FSDP shards over dp_shard x cp


def test_model_checks_name_the_fix():
    # The debug model: 8 heads, 4 K/V heads, 4 layers.
    with pytest.raises(ConfigError, match="tp = 3 must divide the attention heads .*choose tp among 1, 2, 4"):
        plan(3, "--parallelism.tp", "3", "--training.seq_len", "63")
    with pytest.raises(ConfigError, match="pp = 8 exceeds the model's 4 layers"):
        plan(8, "--parallelism.pp", "8")
    with pytest.raises(ConfigError, match="divisible by tp = 4"):
        plan(4, "--parallelism.tp", "4", "--training.seq_len", "66")
    with pytest.raises(ConfigError, match="2 x cp"):
        plan(2, "--parallelism.cp", "2", "--training.seq_len", "66")
    plan(4, "--parallelism.tp", "2", "--training.seq_len", "64")  # fits


def test_mesh_dims_order_and_flattened_views(fake_world):
    fake_world(16)
    d = dims(16, dp_replicate=2, tp=2, pp=2)
    mesh = d.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(mesh.shape) == (2, 2, 2, 1, 2)
    assert mesh["dp"].size() == 4  # dp_replicate x dp_shard: data loading
    assert mesh["dp_shard_cp"].size() == 2  # FSDP's shard dimension
    assert mesh["dp_cp"].size() == 4  # loss and gradient-norm reduction
    # TP innermost (neighbouring ranks, the fastest links), PP outermost.
    assert mesh["tp"].mesh.tolist() == [0, 1]
    assert mesh["pp"].mesh.tolist() == [0, 8]
    assert mesh["dp_replicate", "dp_shard_cp"].mesh.tolist() == [[0, 2], [4, 6]]


def test_mesh_of_a_later_rank(fake_world):
    fake_world(8, rank=5)
    mesh = dims(8, tp=2).build_mesh("cpu")
    assert mesh["tp"].mesh.tolist() == [4, 5]
    assert mesh["dp"].mesh.tolist() == [1, 3, 5, 7]
    assert mesh["dp"].get_local_rank() == 2


def test_mesh_views_are_kept_not_sliced_from_the_root(fake_world):
    """torch deprecates slicing a flattened dimension from the root mesh ("Slicing a flattened dim from
    root mesh will be deprecated"): every view the trainer and parallelize_llama take is the mesh kept
    when it was made, so none of them warns."""
    import warnings

    fake_world(16)
    d = dims(16, dp_replicate=2, cp=2, tp=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        mesh = d.build_mesh("cpu")
        views = {name: mesh[name] for name in ("dp", "dp_shard_cp", "dp_cp", "tp", "cp", "pp")}
        hsdp = mesh["dp_replicate", "dp_shard_cp"]
    assert {n: v.mesh_dim_names for n, v in views.items()} == {n: (n,) for n in views}
    assert mesh["dp_cp"] is views["dp_cp"]  # the same mesh (and process group) every time
    # The HSDP view joins the replicate dimension and FSDP's flattened shard dimension, with their groups.
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(hsdp.shape) == (2, 4)
    assert hsdp.mesh.tolist() == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert hsdp.get_group(0) is mesh["dp_replicate"].get_group()
    assert hsdp.get_group(1) is views["dp_shard_cp"].get_group()
    assert mesh.root.mesh_dim_names == mesh.mesh_dim_names  # the rest is the root DeviceMesh's


def test_expert_parallel_splits_dp_shard_into_efsdp_and_ep(fake_world):
    """ep borrows from dp_shard: inner `ep` (neighbouring ranks for the all-to-all), outer `efsdp`, and
    `dp_shard` their flattened view, so the rest of the mesh reads as without EP."""
    fake_world(16)
    d = ParallelDims(dp_replicate=1, dp_shard=-1, cp=2, tp=1, pp=2, world_size=16, ep=2)
    mesh = d.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")
    assert tuple(mesh.shape) == (2, 1, 2, 2, 2, 1)
    assert mesh["ep"].mesh.tolist() == [0, 2]  # cp is inner still: EP peers are 2 ranks apart
    assert mesh["dp_shard"].mesh.tolist() == [0, 2, 4, 6]
    assert mesh["dp_shard_cp"].size() == 8  # the dense weights' FSDP
    assert mesh["efsdp_cp"].mesh.tolist() == [0, 1, 4, 5]  # the experts' FSDP: not EP peers
    assert mesh["dp"].size() == 4 and mesh["dp_cp"].size() == 8
