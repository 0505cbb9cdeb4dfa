"""parallelize_llama on the meta device over fake process groups: placements, FSDP units, the order, errors;
activation checkpointing on real CPU tensors (what is recomputed); compile's names.

Numerical parity of every mesh with one process is in tests/parallel (real gloo processes).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from titanrush import config
from titanrush.config import ConfigError
from titanrush.models.init import _canonical
from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.parallelize import parallelize_llama
from titanrush.parallel.activation_checkpoint import ACPlan, apply_ac
from titanrush.parallel.compile import OVERLAP_PASSES, CompilePlan, apply_compile
from titanrush.run.plan import RunPlan, build_plan


def run_plan(world: int, *args: str) -> RunPlan:
    """The run plan of the debug model with these overrides (as the trainer resolves it) on `world` ranks."""
    return build_plan(config.load(None, list(args)), world, machine=False)


def parallel(
    world: int, *args: str, ac: str = "none", precision: str = "fp32", **par: object
) -> torch.nn.Module:
    """The debug Llama on meta, parallelized over a fake world of `world` ranks (`par`: parallelism keys)."""
    flags = [
        *args,
        "--activation_checkpoint.mode",
        ac,
        "--training.precision",
        precision,
        "--training.seq_len",
        "64",
    ]
    for key, value in par.items():
        flags += [f"--parallelism.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    plan = run_plan(world, *flags)
    mesh = plan.dims.build_mesh("cpu") if world > 1 else None
    with torch.device("meta"):
        model = Llama(plan.args)
    parallelize_llama(model, mesh, plan.parallelize_plan)
    return model


def test_unsupported_combinations_are_config_errors():
    with pytest.raises(ConfigError, match="DDP .* does not compose with tensor parallel"):
        run_plan(4, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1", "--parallelism.tp", "2")
    with pytest.raises(ConfigError, match="fsdp_cpu_offload needs FSDP"):
        run_plan(1, "--parallelism.fsdp_cpu_offload")
    with pytest.raises(ConfigError, match="training.loss = chunked"):
        run_plan(2, "--parallelism.tp", "2", "--training.loss", "chunked")


def placements(model: torch.nn.Module) -> dict[str, tuple]:
    return {_canonical(n): tuple(p.placements) for n, p in model.named_parameters()}


def test_tp_plan_shards_columns_rows_and_vocab(fake_world):
    fake_world(2)
    pl = placements(parallel(2, tp=2))
    assert pl["tok_embeddings.weight"] == (Shard(0),)  # vocabulary
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert pl[f"layers.0.{name}.weight"] == (Shard(0),), name  # column-wise: output features
    for name in ("attention.wo", "feed_forward.w2"):
        assert pl[f"layers.3.{name}.weight"] == (Shard(1),), name  # row-wise: input features
    for name in ("layers.1.attention_norm.weight", "layers.1.ffn_norm.weight", "norm.weight"):
        assert pl[name] == (Replicate(),), name
    assert pl["output.weight"] == (Shard(0),)


def test_tp_without_sequence_parallel_still_makes_every_parameter_a_dtensor(fake_world):
    # The fused optimizer refuses a mix of DTensors and plain tensors.
    fake_world(2)
    model = parallel(2, tp=2, sequence_parallel=False, loss_parallel=False)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert placements(model)["norm.weight"] == (Replicate(),)


def test_tied_embeddings_stay_one_parameter_under_tp_and_fsdp(fake_world):
    fake_world(4)
    model = parallel(4, "--model.tie_embeddings", "tied", tp=2)
    assert model.output.weight is model.tok_embeddings.weight
    weight = model.tok_embeddings.weight
    assert weight.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp")
    assert weight.placements[1] == Shard(0)  # TP: the vocabulary, for the embedding and the output alike
    assert not isinstance(model.tok_embeddings, FSDPModule)  # both live in the root unit


def test_fsdp_units_and_2d_placements(fake_world):
    fake_world(4)
    model = parallel(4, tp=2)
    assert isinstance(model, FSDPModule)
    assert isinstance(model.tok_embeddings, FSDPModule) and isinstance(model.norm, FSDPModule)
    assert all(isinstance(b, FSDPModule) for b in model.layers.values())
    wq = model.layers["0"].attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp")
    assert wq.to_local().shape == (256 // 2 // 2, 256)


def test_fsdp_shards_over_dp_shard_and_cp_together(fake_world):
    # The cp ranks hold the same weights: FSDP shards them over dp_shard x cp.
    fake_world(4)
    w1 = parallel(4, dp_shard=2, cp=2).layers["0"].feed_forward.w1.weight
    assert w1.device_mesh.mesh_dim_names == ("dp_shard_cp",) and w1.device_mesh.size() == 4


def test_hsdp_shards_within_and_replicates_across(fake_world):
    fake_world(4)
    model = parallel(4, dp_replicate=2, dp_shard=2)
    w1 = model.layers["0"].feed_forward.w1.weight
    assert w1.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert tuple(w1.placements) == (Replicate(), Shard(0))


def _resharded(module: FSDPModule) -> bool:
    # FSDP keeps no post-forward mesh for a unit that stays gathered after forward.
    return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None


@pytest.mark.parametrize(
    "policy, keep, blocks, emb, head",
    [
        ("default", 0, [True, True, True, False], True, False),
        ("default", 2, [True, True, False, False], True, False),  # the last 2 blocks keep theirs
        ("default", 4, [False] * 4, True, False),
        ("always", 0, [True] * 4, True, True),
        ("never", 0, [False] * 4, False, False),
    ],
)
def test_reshard_after_forward_policies(fake_world, policy, keep, blocks, emb, head):
    fake_world(2)
    model = parallel(2, fsdp_reshard_after_forward=policy, fsdp_keep_gathered_last=keep)
    assert [_resharded(b) for b in model.layers.values()] == blocks
    assert _resharded(model.tok_embeddings) == emb
    assert _resharded(model.norm) == head


def test_bf16_mixed_precision_reduces_in_fp32(fake_world):
    fake_world(2)
    model = parallel(2, precision="bf16")
    mp = model.layers["0"]._get_fsdp_state()._mp_policy
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights


def test_ddp_for_replicas_without_sharding(fake_world):
    fake_world(2)
    model = parallel(2, dp_replicate=2, dp_shard=1)
    assert type(model).__name__ == "DDPLlama"
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_ac_then_fsdp_wrap_in_that_order(fake_world):
    fake_world(2)
    model = parallel(2, ac="full")
    block = model.layers["0"]
    assert isinstance(block, FSDPModule)  # FSDP outermost
    assert "_checkpoint_wrapped_module" in dict(block.named_children())


# ------------------------------------------------------------------------------------------------
# Activation checkpointing and compile on one process


class CountMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def backward_mms(
    mode: str, selective: str = "op", op_matmuls: str = "all", op_all_last: int = 0
) -> tuple[int, float, torch.Tensor]:
    """Matmuls run during backward, the loss and one gradient of a small Llama under the given AC."""
    torch.manual_seed(0)
    model = Llama(model_args("debug", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128))
    model.init_weights(seed=1)
    apply_ac(model, ACPlan(mode=mode, selective=selective, op_matmuls=op_matmuls, op_all_last=op_all_last))
    tokens = torch.randint(0, 128, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    with CountMM() as counter:
        loss.backward()
    grad = dict((_canonical(n), p.grad) for n, p in model.named_parameters())["layers.0.attention.wq.weight"]
    return counter.n, loss.item(), grad


def test_ac_recomputes_what_each_mode_says():
    base, loss, grad = backward_mms("none")
    per_block = 7  # wq wk wv wo w1 w3 w2
    assert base == 2 * (4 * per_block + 1)  # input and weight gradient of every linear
    full, loss_full, grad_full = backward_mms("full")
    every2, _, _ = backward_mms("selective", "2")
    op, loss_op, grad_op = backward_mms("selective", "op")
    # Full: each block's forward matmuls run again (w2, whose output backward never needs, may be skipped).
    assert base + 4 * (per_block - 1) <= full <= base + 4 * per_block
    assert every2 - base == (full - base) // 2  # blocks 1 and 3 of 0..3
    assert op == base  # selective op keeps every matmul output: no matmul is recomputed
    assert loss_full == loss_op == loss
    torch.testing.assert_close(grad_full, grad, rtol=0, atol=0)
    torch.testing.assert_close(grad_op, grad, rtol=0, atol=0)


def test_ac_op_alternate_recomputes_every_other_matmul():
    base, loss, grad = backward_mms("none")
    alt, loss_alt, grad_alt = backward_mms("selective", "op", op_matmuls="alternate")
    # Per block the 2nd, 4th and 6th matmul (wk, wo, w3) run again in backward: 3 of 7, in 4 blocks.
    assert alt - base == 4 * 3
    assert loss_alt == loss
    torch.testing.assert_close(grad_alt, grad, rtol=0, atol=0)


def test_ac_op_all_last_keeps_every_matmul_in_the_last_blocks():
    base, loss, grad = backward_mms("none")
    for last in (1, 3):  # the other blocks still recompute wk, wo and w3
        n, loss_n, grad_n = backward_mms("selective", "op", op_matmuls="alternate", op_all_last=last)
        assert n - base == (4 - last) * 3
        assert loss_n == loss
        torch.testing.assert_close(grad_n, grad, rtol=0, atol=0)
    assert backward_mms("selective", "op", op_matmuls="alternate", op_all_last=4)[0] == base


def test_ac_op_all_last_counts_blocks_of_the_whole_model_on_a_pipeline_stage():
    # A first stage holding blocks 0 and 1 of 4 (keys are global indices): op_all_last = 2 is blocks 2
    # and 3, on the other stage; 3 adds block 1; 4 both of this stage's blocks.
    def stage_recomputed(last: int) -> int:
        torch.manual_seed(0)
        model = Llama(model_args("debug", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128))
        del model.layers["2"], model.layers["3"]
        apply_ac(model, ACPlan(mode="selective", selective="op", op_matmuls="alternate", op_all_last=last))
        loss = model(torch.randint(0, 128, (2, 16))).float().square().mean()
        with CountMM() as counter:
            loss.backward()
        return counter.n

    alternate = stage_recomputed(0)
    assert stage_recomputed(2) == alternate
    assert alternate - stage_recomputed(3) == 3  # wk, wo and w3 of block 1
    assert alternate - stage_recomputed(4) == 6
    with pytest.raises(ConfigError, match="op_all_last = 5: the debug model has 4 blocks"):
        run_plan(
            1,
            *("--activation_checkpoint.mode", "selective", "--activation_checkpoint.op_matmuls"),
            *("alternate", "--activation_checkpoint.op_all_last", "5"),
        )


def test_ac_none_and_bad_values():
    model = Llama(model_args("debug", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128))
    apply_ac(model, ACPlan(mode="none"))
    assert "_checkpoint_wrapped_module" not in dict(model.layers["0"].named_children())
    with pytest.raises(ConfigError, match="activation_checkpoint.selective"):
        run_plan(1, "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "0")
    with pytest.raises(ConfigError, match="activation_checkpoint.op_matmuls"):
        run_plan(1, "--activation_checkpoint.op_matmuls", "half")


def test_compile_replaces_blocks_and_names_stay_loadable():
    with torch.device("meta"):
        model = Llama(model_args("debug"))
    before = [n for n, _ in model.named_parameters()]
    apply_ac(model, ACPlan(mode="full"))
    apply_compile(model, CompilePlan(enable=True, fullgraph=True))
    assert type(model.layers["0"]).__name__ == "OptimizedModule"
    after = [n for n, _ in model.named_parameters()]
    assert after[1].startswith("layers.0._orig_mod._checkpoint_wrapped_module.")
    assert [_canonical(n) for n in after] == before


def test_float8_tp_keeps_plain_styles_for_a_part_with_bf16_linears(fake_world, caplog, monkeypatch):
    # The 1B's situation in small: wk and wv (dim x kv dim) fall below float8.min_size and stay bf16,
    # so attention keeps the plain TP styles while the FFN (all float8) shards in float8.
    pytest.importorskip("torchao", reason="float8 is torchao's; it is a project dependency")
    from torchao.float8.float8_linear import Float8Linear

    fake_world(2)
    plan = run_plan(2, *("--parallelism.tp", "2", "--training.precision", "bf16", "--float8.enable"))
    plan = dataclasses.replace(
        plan,
        args=model_args("debug", dim=256, n_heads=8, n_kv_heads=2, multiple_of=64),
        float8=dataclasses.replace(plan.float8, emulate=True, min_size=128),
    )
    with torch.device("meta"):
        model = Llama(plan.args)
    # (a test before this one may have run the trainer's logging setup, which stops propagation)
    monkeypatch.setattr(logging.getLogger("titanrush"), "propagate", True)
    with caplog.at_level("INFO", logger="titanrush"):
        parallelize_llama(model, plan.dims.build_mesh("cpu"), plan.parallelize_plan)
    block = model.layers["0"]
    assert isinstance(block.attention.wq, Float8Linear) and not isinstance(block.attention.wk, Float8Linear)
    assert all(isinstance(getattr(block.feed_forward, n), Float8Linear) for n in ("w1", "w2", "w3"))
    assert "attention keeps bf16 TP styles (wk, wv not converted)" in caplog.text
    assert "feed_forward keeps" not in caplog.text
    pl = placements(model)
    assert pl["layers.0.attention.wk.weight"] == (Shard(0),)
    assert pl["layers.0.feed_forward.w2.weight"] == (Shard(1),)


@pytest.mark.parametrize("moe_every", [1, 2], ids=["all_moe", "dense_and_moe"])
def test_float8_tp_on_llama4_judges_the_ffn_by_the_blocks_that_have_one(fake_world, moe_every):
    # A Llama 4 MoE block has no `feed_forward`: attention takes the float8 styles, and the FFN too where
    # dense blocks have one; the MoE layers are FSDP-sharded over the tp ranks instead (not TP-sharded).
    pytest.importorskip("torchao", reason="float8 is torchao's; it is a project dependency")
    from torchao.float8.float8_linear import Float8Linear

    from titanrush.models.llama.parallelize import _float8_parts
    from titanrush.models.llama4 import Llama4

    fake_world(2)
    flags = ["--model.flavor", "llama4_debug", "--parallelism.tp", "2", "--training.precision", "bf16"]
    plan = run_plan(2, *flags, "--float8.enable", "--float8.emulate", "--float8.min_size", "0")
    plan = dataclasses.replace(plan, args=dataclasses.replace(plan.args, moe_every=moe_every))
    with torch.device("meta"):
        model = Llama4(plan.args)
    parallelize_llama(model, plan.dims.build_mesh("cpu"), plan.parallelize_plan)
    blocks = list(model.layers.values())
    expected = {"attention"} | ({"feed_forward"} if moe_every == 2 else set())
    assert _float8_parts(blocks) == expected
    # A bf16 linear in any block, not only the first, keeps its part on the plain styles.
    last_dense = [b for b in blocks if b.feed_forward is not None][-1:] or blocks[-1:]
    part = "feed_forward" if moe_every == 2 else "attention"
    setattr(getattr(last_dense[0], part), "w2" if moe_every == 2 else "wo", torch.nn.Linear(4, 4))
    assert _float8_parts(blocks) == expected - {part}
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    gate = model.layers[str(plan.args.n_layers - 1)].moe.router.gate.weight
    assert gate.device_mesh.mesh_dim_names == ("dp_shard_cp_tp",)
    assert model.layers["0"].attention.wq.weight.device_mesh.mesh_dim_names == ("tp",)


def test_fsdp_bf16_casts_block_inputs_but_not_the_rope_table(fake_world):
    # Under FSDP's bf16 policy the residual stream reaches every block in bf16 (the embedding's output,
    # then each block's), while the block units cast nothing: the fp32 RoPE table arrives as the model's
    # own buffer, so no block rotates with a rounded table or keeps a bf16 copy of it for backward.
    fake_world(2)
    model = parallel(2, dp_shard=2, precision="bf16")
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    seen = []

    def grab(module, args):
        seen.append((args[0].dtype, args[1].dtype, args[1].untyped_storage().data_ptr()))

    for block in model.layers.values():
        block.register_forward_pre_hook(grab)
    with torch.no_grad():
        model(torch.randint(0, 8192, (2, 16)))  # a fake world: values are garbage, dtypes are real
    table = model.rope.untyped_storage().data_ptr()
    assert model.rope.dtype == torch.float32
    assert seen == [(torch.bfloat16, torch.float32, table)] * len(model.layers)


def test_compiled_blocks_keep_their_own_selective_policy():
    # Every block runs the same forward code: under torch.compile the blocks share one cache of graphs,
    # told apart by guards. With the policy hidden in a closure, every block ran the graph compiled for
    # block 0 (op_all_last had no effect, or made every block keep all). aot_eager runs the compiled
    # graphs op by op, so the dispatch mode sees the backward's matmuls.
    import torch._dynamo

    def compiled_backward_mms(op_all_last: int) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(model_args("debug", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128))
        model.init_weights(seed=1)
        apply_ac(
            model, ACPlan(mode="selective", selective="op", op_matmuls="alternate", op_all_last=op_all_last)
        )
        for name, block in list(model.layers.items()):
            model.layers.register_module(name, torch.compile(block, backend="aot_eager", fullgraph=True))
        tokens = torch.randint(0, 128, (2, 16))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        with CountMM() as counter:
            loss.backward()
        return counter.n

    eager = [backward_mms("selective", "op", op_matmuls="alternate", op_all_last=k)[0] for k in (0, 2, 4)]
    assert eager[0] - eager[1] == 2 * 3 and eager[1] - eager[2] == 2 * 3  # 3 recomputed mms per block
    assert [compiled_backward_mms(k) for k in (0, 2, 4)] == eager


def test_ac_op_all_but_w3_recomputes_one_matmul_per_block():
    base, loss, grad = backward_mms("none")
    n, loss_n, grad_n = backward_mms("selective", "op", op_matmuls="all_but_w3")
    assert n - base == 4  # the 6th matmul (w3) of each of the 4 blocks runs again in backward
    assert loss_n == loss
    torch.testing.assert_close(grad_n, grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "world, par, router_mesh, experts_mesh, divide",
    [
        # TP alone: the MoE layer is a unit of its own over the tp ranks; each routes its sequence
        # shard, so its gradients are summed over them (divided by the data-parallel degree, 1)
        (2, {"tp": 2}, ("dp_shard_cp_tp",), ("dp_shard_cp_tp",), 1),
        # without sequence parallel both tp ranks route the same tokens: averaged over them
        (2, {"tp": 2, "sequence_parallel": False}, ("dp_shard_cp_tp",), ("dp_shard_cp_tp",), 2),
        (4, {"tp": 2, "dp_shard": 2}, ("dp_shard_cp_tp",), ("dp_shard_cp_tp",), 2),
        # HSDP x EP x TP: the experts over the replicas and the non-EP shard ranks x tp, split over ep
        (
            16,
            {"tp": 2, "dp_replicate": 2, "dp_shard": 4, "ep": 2},
            ("dp_replicate", "dp_shard_cp_tp"),
            ("dp_replicate", "efsdp_cp_tp", "ep"),
            8,
        ),
    ],
    ids=["tp2", "tp2_no_sp", "fsdp2_tp2", "hsdp2_ep2_tp2"],
)
def test_moe_layers_under_tp_are_fsdp_units_over_the_tp_ranks(
    fake_world, world, par, router_mesh, experts_mesh, divide
):
    from titanrush.models.llama4 import Llama4

    fake_world(world)
    flags = ["--model.flavor", "llama4_debug", "--training.seq_len", "64"]
    for key, value in par.items():
        flags += [f"--parallelism.{key}", str(value).lower()]
    plan = run_plan(world, *flags)
    with torch.device("meta"):
        model = Llama4(plan.args)
    parallelize_llama(model, plan.dims.build_mesh("cpu"), plan.parallelize_plan)
    moe = model.layers["0"].moe
    assert isinstance(moe, FSDPModule)
    assert moe.router.gate.weight.device_mesh.mesh_dim_names == router_mesh
    assert moe.experts.w13.device_mesh.mesh_dim_names == experts_mesh
    assert model.layers["0"].attention.wq.weight.device_mesh.mesh_dim_names[-1] == "tp"
    for unit in (moe, moe.experts) if plan.ep > 1 else (moe,):
        assert unit._get_fsdp_state()._fsdp_param_group.gradient_divide_factor == divide


@pytest.mark.parametrize(
    "args, world, overlap",
    [
        (("--compile.enable", "--parallelism.tp", "2"), 2, True),
        (("--compile.enable", "--parallelism.tp", "2", "--no-compile.overlap_collectives"), 2, False),
        (("--parallelism.tp", "2"), 2, False),  # nothing compiled
        (("--compile.enable",), 2, False),  # FSDP's collectives run outside the compiled blocks
        (("--compile.enable", "--parallelism.tp", "2", "--experimental.async_tp"), 2, True),
    ],
)
def test_compiled_blocks_overlap_tensor_parallel_collectives(fake_world, monkeypatch, args, world, overlap):
    """The plan turns compile.overlap_collectives on where compiled blocks hold collectives (TP), and every
    compiled block gets Inductor's reordering passes (with async TP, the micro-pipelining option too)."""
    seen: list[dict | None] = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: seen.append(kw.get("options")) or real(m, **kw))
    fake_world(world)
    plan = run_plan(world, *args)
    assert plan.compile.overlap_collectives is overlap
    model = parallel(world, *args)
    assert len(seen) == len(model.layers) if plan.compile.enable else not seen
    assert plan.compile.async_tp is ("--experimental.async_tp" in args)
    for options in seen:
        assert options is None if not overlap else options["reorder_for_compute_comm_overlap"] is True
        assert (options or {}).get("_micro_pipeline_tp", False) is plan.compile.async_tp, options
        if overlap:
            assert options["reorder_for_compute_comm_overlap_passes"] == list(OVERLAP_PASSES)


@pytest.mark.parametrize("async_tp", [True, False])
def test_async_tp_registers_the_tp_group_for_symmetric_memory(fake_world, monkeypatch, async_tp):
    """Inductor's async TP fuses only over groups registered with symmetric memory: the tp group is."""
    import torch.distributed._symmetric_memory as symm

    seen: list[str] = []
    monkeypatch.setattr(symm, "enable_symm_mem_for_group", seen.append)
    fake_world(4)
    flags = ("--compile.enable", "--parallelism.tp", "2") + (("--experimental.async_tp",) if async_tp else ())
    plan = run_plan(4, *flags)
    mesh = plan.dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(plan.args)
    parallelize_llama(model, mesh, plan.parallelize_plan)
    assert seen == ([mesh["tp"].get_group().group_name] if async_tp else [])


@pytest.mark.parametrize(
    "world, par, local",
    [
        (2, {"ep": 2, "compile.enable": True}, True),  # EP over both data-parallel ranks, compiled
        # (full AC: the checkpointed block recomputes the casts anyway, so the experts need not)
        (2, {"ep": 2, "compile.enable": True, "activation_checkpoint.mode": "full"}, True),
        (2, {"ep": 2}, False),  # eager: autograd would keep every layer's bf16 cast of its experts
        (4, {"ep": 2, "compile.enable": True}, False),  # EP 2 x FSDP 2: units over the two EP groups
        (4, {"ep": 2, "dp_replicate": 2, "dp_shard": 2, "compile.enable": True}, False),  # HSDP
        (4, {"ep": 2, "dp_shard": 2, "cp": 2, "compile.enable": True}, False),  # cp ranks share experts
    ],
    ids=["ep2", "ep2_full_ac", "ep2_eager", "ep2_fsdp2", "hsdp2_ep2", "ep2_cp2"],
)
def test_experts_take_no_fsdp_unit_where_expert_parallel_spans_every_data_parallel_rank(
    fake_world, caplog, world, par, local
):
    from titanrush.models.llama4 import Llama4

    fake_world(world)
    flags = ["--model.flavor", "llama4_debug", "--training.seq_len", "64", "--training.precision", "bf16"]
    for key, value in par.items():
        flag = f"--{key}" if "." in key else f"--parallelism.{key}"
        flags += [flag] if value is True else [flag, str(value)]
    plan = run_plan(world, *flags)
    assert plan.local_experts is local
    with torch.device("meta"):
        model = Llama4(plan.args)
    with caplog.at_level("INFO", logger="titanrush"):
        parallelize_llama(model, plan.dims.build_mesh("cpu"), plan.parallelize_plan)
    assert ("the experts take no FSDP unit" in caplog.text) is local  # (the run says so)
    unit = model.layers["0"]  # (compiled: the wrapper is the FSDP unit)
    experts = getattr(unit, "_orig_mod", unit).moe.experts
    managed = {id(p.sharded_param) for p in unit._get_fsdp_state()._fsdp_param_group.fsdp_params}
    assert isinstance(experts, FSDPModule) is not local
    if local:  # the experts keep their EP placement, no FSDP unit holds them, and they cast and divide
        assert experts.w13.device_mesh.mesh_dim_names == ("ep",)
        assert id(experts.w13) not in managed and id(experts.w2) not in managed
        assert experts.compute_dtype == torch.bfloat16 and experts.grad_divisor == plan.dp * plan.cp
        assert experts.recast is (plan.ac.mode == "none")  # (cast again in backward, not kept)
    else:
        assert experts.compute_dtype is None and experts.grad_divisor == 1.0


def test_local_experts_cast_for_the_gemms_and_divide_their_gradients():
    from titanrush.models.llama4.moe import GroupedExperts

    torch.manual_seed(0)
    plain = GroupedExperts(8, 16, 2, grouped=False)
    for w in plain.parameters():
        torch.nn.init.normal_(w)
    local = GroupedExperts(8, 16, 2, grouped=False)
    local.load_state_dict(plain.state_dict())
    local.compute_dtype, local.grad_divisor = torch.bfloat16, 4.0
    x, counts = torch.randn(6, 8, dtype=torch.bfloat16), torch.tensor([4, 2])
    as_fsdp = GroupedExperts(8, 16, 2, grouped=False).to(torch.bfloat16)  # what FSDP's bf16 gather computes
    as_fsdp.load_state_dict(plain.state_dict())
    out = local(x, counts)
    assert out.dtype == torch.bfloat16 and torch.equal(out, as_fsdp(x, counts))
    out.float().sum().backward()
    as_fsdp(x, counts).float().sum().backward()
    for mine, ref in zip(local.parameters(), as_fsdp.parameters()):
        assert mine.grad.dtype == torch.float32  # on the fp32 weights, as FSDP's fp32 reduce leaves them
        torch.testing.assert_close(mine.grad, ref.grad.float() / 4.0)


def _keeper(kept: list[torch.Tensor]):
    """A saved-tensors pack hook that records what autograd keeps."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    return pack


def test_local_experts_cast_again_in_backward_rather_than_keep_the_casts():
    """Compiled, local experts with `recast` keep no bf16 copy of their weights for backward (without it
    the graph keeps casts: on `llama4_1Bx16E` both weights', 2 bytes per expert weight and layer); backward
    casts again, to the same gradients."""
    from titanrush.models.llama4.moe import GroupedExperts

    torch.manual_seed(0)
    x, counts = torch.randn(64, 32, dtype=torch.bfloat16), torch.tensor([16, 16, 32])
    saved, grads = {}, {}
    for recast in (False, True):
        experts = GroupedExperts(32, 48, 3)
        torch.manual_seed(1)
        for w in experts.parameters():
            torch.nn.init.normal_(w, std=0.1)
        experts.compute_dtype, experts.grad_divisor, experts.recast = torch.bfloat16, 2.0, recast
        torch._dynamo.reset()
        step = torch.compile(experts, fullgraph=True)  # (traced: the recast's checkpoint is compiled)
        kept: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(_keeper(kept), lambda t: t):
            out = step(x, counts)
        out.float().square().sum().backward()
        weights = {(tuple(p.shape), tuple(p.mT.shape)) for p in experts.parameters()}
        saved[recast] = [t for t in kept if t.dtype == torch.bfloat16 and t.dim() == 3]
        assert all(tuple(t.shape) in {s for pair in weights for s in pair} for t in saved[recast])
        grads[recast] = [p.grad for p in experts.parameters()]
    assert saved[False] and saved[True] == []  # without recast the graph keeps casts (which: its choice)
    for with_recast, without in zip(grads[True], grads[False]):
        assert with_recast.dtype == torch.float32
        torch.testing.assert_close(with_recast, without, rtol=0, atol=0)
