"""Context parallel with pipeline parallel (and TP, FSDP): what is validated and what stays refused, the
sharding of the batch and the RoPE tables for a step (on fake process groups, the layout torch's own
context_parallel uses), the sweep's 4-D shapes, and the memory estimator on a CP x PP plan.

Ring attention itself needs CUDA (SDPA's GPU kernels): the parity of CP x PP runs with one GPU is in
tests/gpu/test_context_parallel_gpu.py, the plumbing through the real trainer on gloo in
tests/parallel/test_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanrush import config
from titanrush.config import ConfigError
from titanrush.models.llama import model_args
from titanrush.models.llama.model import rope_cache
from titanrush.parallel.context_parallel import context_parallel_step, cp_step_context
from titanrush.run import memory_model
from titanrush.run.plan import build_plan
from titanrush.tools import sweep

P = "--parallelism."
SEQ = ["--training.seq_len", "64", "--training.local_batch_size", "4"]


def plan_of(world: int, *args: str, machine: bool = False):
    """The debug model's run plan on `world` GPUs (machine=False: as on the GPU machine)."""
    return build_plan(config.load(None, [*SEQ, *args]), world, machine=machine)


# ----------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "precision, cp, expanded", [("fp32", 2, True), ("bf16", 2, False), ("fp32", 1, False)]
)
def test_kv_heads_are_repeated_only_for_the_fp32_ring(precision, cp, expanded):
    """Under context parallel in bf16 the ring rotates the grouped K/V heads (cuDNN and flash take them),
    n_heads / n_kv_heads times less than repeated heads; fp32's kernel needs them repeated."""
    plan = plan_of(2, P + "cp", str(cp), "--training.precision", precision)
    assert plan.args.expand_kv is expanded
    assert plan.args.n_kv_heads < plan.args.n_heads  # (the debug model groups its K/V heads)


@pytest.mark.parametrize(
    "world, args",
    [
        (4, [P + "cp", "2", P + "pp", "2"]),
        (4, [P + "cp", "2", P + "pp", "2", P + "pp_schedule", "ZBVZeroBubble"]),
        (4, [P + "cp", "2", P + "pp", "2", P + "pp_schedule", "Interleaved1F1B"]),
        (8, [P + "cp", "2", P + "pp", "2", P + "tp", "2"]),  # the full 4-D mesh, dp_shard the rest (1)
        (8, [P + "cp", "2", P + "pp", "2", P + "dp_shard", "2"]),
        (16, [P + "cp", "2", P + "pp", "2", P + "tp", "2", P + "dp_shard", "2"]),
    ],
    ids=[
        "cp2_pp2",
        "cp2_pp2_zbv",
        "cp2_pp2_interleaved",
        "cp2_pp2_tp2",
        "cp2_pp2_fsdp2",
        "cp2_pp2_tp2_fsdp2",
    ],
)
def test_cp_with_pp_is_a_valid_plan(world, args):
    plan = plan_of(world, *args)
    assert plan.cp == 2 and plan.pp == 2
    assert plan.fsdp and plan.fsdp_shard == 2 * plan.dp_shard  # FSDP over dp_shard x cp
    assert plan.fsdp_plan.reshard == "never"  # pipelined stages keep their weights gathered
    assert plan.args.expand_kv  # fp32: the ring's memory-efficient kernel takes no grouped K/V heads
    # One RoPE row per position of the sequence: what the sharding of the table with the batch needs.
    assert plan.args.rope_len == plan.seq_len
    assert plan.tokens_per_gpu_step == plan.local_batch * plan.seq_len / (2 * 2 * plan.tp)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.attn_backend", "flex"], "parallelism.cp > 1 needs model.attn_backend = 'sdpa' or 'cudnn'"),
        (["--model.attn_backend", "math"], "ring attention replaces SDPA"),
        (["--training.seq_len", "34"], "must be divisible by 2 x cp = 4"),
        (["--model.tie_embeddings", "tied"], "cannot tie the embedding"),  # the pipeline's own rules stay
        (["--training.local_batch_size", "3"], "must be divisible by the pipeline's 2 micro-batches"),
    ],
)
def test_what_cp_with_pp_still_refuses(args, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(4, P + "cp", "2", P + "pp", "2", *args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cp_with_pp_needs_cuda_here():
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        plan_of(4, P + "cp", "2", P + "pp", "2", machine=True)


# ----------------------------------------------------------------------------------------------
# Sharding the batch and the RoPE tables for one step


@pytest.fixture
def cp_mesh_of():
    """A cp mesh of 2 on a fake process group, as rank `rank` sees it."""

    def make(rank: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        return init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_tables_are_sharded_like_the_tokens_so_every_token_keeps_its_position(cp_mesh_of):
    """Tokens 0..T-1 are their own positions: inside the step, row j of every stage's table must be the
    whole table's row at token j's position, on every cp rank; the ranks' positions cover the sequence
    once; the tables are whole again after the step, and the batch stays sharded."""
    args = model_args("debug")
    seq, batch = 16, 4
    full = rope_cache(args, seq)
    seen: list[int] = []
    for rank in (0, 1):
        mesh = cp_mesh_of(rank)
        tokens = torch.arange(seq).repeat(batch, 1)  # (B, T): each token is its position
        labels = tokens + 1
        stages = [full.clone(), full.clone()]  # two pipeline stages of this rank, one table each
        with context_parallel_step(mesh, [tokens, labels], stages):
            assert tokens.shape == labels.shape == (batch, seq // 2)
            assert torch.equal(labels, tokens + 1)  # sharded alike
            for table in stages:
                assert table.shape == (seq // 2, *full.shape[1:])
                assert torch.equal(table, full[tokens[0]])
            # The schedule cuts micro-batches along the batch: each holds the same positions.
            assert all(torch.equal(mb[0], tokens[0]) for mb in tokens.chunk(2))
            # SDPA is swapped for ring attention inside the step only.
            assert F.scaled_dot_product_attention is not torch._C._nn.scaled_dot_product_attention
        seen += tokens[0].tolist()
        assert tokens.shape == (batch, seq // 2)  # the batch is this step's: not restored
        assert all(torch.equal(t, full) for t in stages)
        assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert sorted(seen) == list(range(seq))


def test_a_table_shared_by_two_parts_is_sharded_once(cp_mesh_of):
    mesh = cp_mesh_of(1)
    full = rope_cache(model_args("debug"), 8)
    table = full.clone()
    tokens = torch.arange(8)[None]
    with context_parallel_step(mesh, [tokens], [table, table]):
        assert torch.equal(table, full[tokens[0]])


def test_a_table_not_one_row_per_position_is_refused(cp_mesh_of):
    mesh = cp_mesh_of(0)
    table = rope_cache(model_args("debug"), 32)  # 2 x the sequence: sharding it would misplace the rows
    tokens = torch.arange(16)[None]
    with pytest.raises(ValueError, match="needs 16 rows"), context_parallel_step(mesh, [tokens], [table]):
        pass
    assert tokens.shape == (1, 16) and table.shape[0] == 32  # refused before anything was sharded


def test_without_cp_the_step_context_changes_nothing():
    tokens, table = torch.arange(8)[None], rope_cache(model_args("debug"), 8)
    with cp_step_context(None, [tokens], [table]):
        assert tokens.shape == (1, 8) and table.shape[0] == 8


# ----------------------------------------------------------------------------------------------
# The sweep lists every 4-D shape


def test_sweep_default_grid_lists_every_valid_4d_shape_of_8_gpus():
    ngpu = 8
    grid = sweep.parse_grid(sweep.default_grid(ngpu))
    base = {"training.seq_len": "64", "training.local_batch_size": "4"}
    valid, invalid = sweep.plan(None, base, grid, ngpu, assume_cuda=True)
    got = {(s["tp"], s["pp"], s["cp"], s["dp_shard"]) for s in valid}
    # The debug model's own limits: tp divides its 4 K/V heads, pp at most its 4 layers; dp_shard takes
    # the rest of the 8 GPUs.
    want = {
        (tp, pp, cp, ngpu // (tp * pp * cp))
        for tp in (1, 2, 4)
        for pp in (1, 2, 4)
        for cp in (1, 2, 4, 8)
        if ngpu % (tp * pp * cp) == 0
    }
    assert got == want
    assert (2, 2, 2, 1) in got and (1, 2, 2, 2) in got  # TP x PP x CP, and PP x CP x FSDP
    assert not [r for _, r in invalid if "not supported" in r]


def test_sweep_on_6_gpus_lists_degree_3():
    grid = sweep.parse_grid(sweep.default_grid(6))
    base = {"training.seq_len": "48", "training.local_batch_size": "6"}
    valid, _ = sweep.plan(None, base, grid, 6, assume_cuda=True)
    got = {(s["tp"], s["pp"], s["cp"], s["dp_shard"]) for s in valid}
    assert {(1, 3, 2, 1), (1, 1, 3, 2), (1, 3, 1, 2)} <= got  # pp 3 x cp 2; cp 3 x FSDP 2; pp 3 x FSDP 2


# ----------------------------------------------------------------------------------------------
# The memory estimator on a CP x PP plan


def test_estimator_evaluates_cp_with_pp():
    """Every pipeline rank of a CP x PP plan evaluates; the sequence split shrinks each rank's
    activations against the same pipeline without CP, and the ring's K/V exchange appears."""
    over = [
        "--model.flavor",
        "8B",
        "--training.seq_len",
        "8192",
        "--training.local_batch_size",
        "2",
        "--training.precision",
        "bf16",
    ]
    cp_pp = plan_of(8, *over, P + "cp", "2", P + "pp", "2", P + "dp_shard", "2")
    pp = plan_of(4, *over, P + "pp", "2", P + "dp_shard", "2")
    ranks_cp, ranks = memory_model.rank_plans(cp_pp), memory_model.rank_plans(pp)
    assert len(ranks_cp) == 2
    for rp_cp, rp in zip(ranks_cp, ranks, strict=True):
        a = memory_model.analyze_rank(cp_pp, rp_cp)
        b = memory_model.analyze_rank(pp, rp)
        assert a.peak > 0
        act = max(m["activations"] for m in a.moments.values())
        act_ref = max(m["activations"] for m in b.moments.values())
        assert act < 0.6 * act_ref  # half the tokens per rank (plus the ring's received K/V)
    total = memory_model.analyze(cp_pp)
    assert total.peak == max(memory_model.analyze_rank(cp_pp, r).peak for r in ranks_cp)
