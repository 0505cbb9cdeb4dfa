"""parallelize_llama on the meta device over fake process groups: placements, FSDP units, the order, errors;
activation checkpointing on real CPU tensors (what is recomputed); compile's names.

Numerical parity of every mesh with one process is in tests/parallel (real gloo processes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from titanrush.config import ActivationCheckpoint, Compile, ConfigError, Float8, Parallelism
from titanrush.models.init import _canonical
from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.parallelize import parallelize_llama
from titanrush.parallel.activation_checkpoint import apply_ac
from titanrush.parallel.compile import apply_compile
from titanrush.parallel.parallel_dims import ParallelDims


@pytest.fixture
def fake_world():
    def init(world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def parallel(
    world: int, *, flavor_over: dict | None = None, ac: str = "none", precision: str = "fp32", **par
):
    """The debug Llama on meta, parallelized over a fake world of `world` ranks."""
    p = Parallelism(**par)
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, world)
    mesh = dims.build_mesh("cpu") if world > 1 else None
    with torch.device("meta"):
        model = Llama(model_args("debug", **(flavor_over or {})))
    parallelize_llama(
        model, dims, mesh, parallelism=p, compile=Compile(), ac=ActivationCheckpoint(mode=ac),
        float8=Float8(), precision=precision,
    )  # fmt: skip
    return model


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
    model = parallel(4, tp=2, flavor_over={"tie_embeddings": True})
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


@pytest.mark.parametrize(
    "over, match",
    [
        ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, "DDP .* does not compose with tensor parallel"),
    ],
)
def test_unsupported_combinations_are_config_errors(fake_world, over, match):
    fake_world(4)
    with pytest.raises(ConfigError, match=match):
        parallel(4, **over)


def test_chunked_loss_with_tp_and_offload_without_fsdp_are_config_errors(fake_world):
    with pytest.raises(ConfigError, match="fsdp_cpu_offload needs FSDP"):
        parallel(1, fsdp_cpu_offload=True)
    fake_world(2)
    with pytest.raises(ConfigError, match="training.loss = chunked"):
        parallel(2, tp=2, flavor_over={"loss_chunk_size": 64})


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
    apply_ac(model, mode=mode, selective=selective, op_matmuls=op_matmuls, op_all_last=op_all_last)
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
        apply_ac(model, mode="selective", selective="op", op_matmuls="alternate", op_all_last=last)
        loss = model(torch.randint(0, 128, (2, 16))).float().square().mean()
        with CountMM() as counter:
            loss.backward()
        return counter.n

    alternate = stage_recomputed(0)
    assert stage_recomputed(2) == alternate
    assert alternate - stage_recomputed(3) == 3  # wk, wo and w3 of block 1
    assert alternate - stage_recomputed(4) == 6
    with pytest.raises(ConfigError, match="op_all_last = 5: the model has 4 blocks"):
        apply_ac(
            Llama(model_args("debug", n_layers=4)), mode="selective", op_matmuls="alternate", op_all_last=5
        )


def test_ac_none_and_bad_values():
    model = Llama(model_args("debug", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128))
    apply_ac(model, mode="none")
    assert "_checkpoint_wrapped_module" not in dict(model.layers["0"].named_children())
    with pytest.raises(ConfigError, match="activation_checkpoint.selective"):
        apply_ac(model, mode="selective", selective="0")
    with pytest.raises(ConfigError, match="activation_checkpoint.op_matmuls"):
        apply_ac(model, mode="selective", selective="op", op_matmuls="half")


def test_compile_replaces_blocks_and_names_stay_loadable():
    with torch.device("meta"):
        model = Llama(model_args("debug"))
    before = [n for n, _ in model.named_parameters()]
    apply_ac(model, mode="full")
    apply_compile(model, fullgraph=True)
    assert type(model.layers["0"]).__name__ == "OptimizedModule"
    after = [n for n, _ in model.named_parameters()]
    assert after[1].startswith("layers.0._orig_mod._checkpoint_wrapped_module.")
    assert [_canonical(n) for n in after] == before


def test_float8_tp_keeps_plain_styles_for_a_part_with_bf16_linears(fake_world, caplog):
    # The 1B's situation in small: wk and wv (dim x kv dim) fall below float8.min_size and stay bf16,
    # so attention keeps the plain TP styles while the FFN (all float8) shards in float8.
    pytest.importorskip("torchao", reason="float8 is torchao's; it is a project dependency")
    from torchao.float8.float8_linear import Float8Linear

    fake_world(2)
    p = Parallelism(tp=2, dp_shard=1)
    dims = ParallelDims(1, 1, 1, 2, 1, 2)
    with torch.device("meta"):
        model = Llama(model_args("debug", dim=256, n_heads=8, n_kv_heads=2, multiple_of=64))
    with caplog.at_level("INFO", logger="titanrush"):
        parallelize_llama(
            model, dims, dims.build_mesh("cpu"), parallelism=p, compile=Compile(), ac=ActivationCheckpoint(),
            float8=Float8(enable=True, emulate=True, min_size=128), precision="bf16",
        )  # fmt: skip
    block = model.layers["0"]
    assert isinstance(block.attention.wq, Float8Linear) and not isinstance(block.attention.wk, Float8Linear)
    assert all(isinstance(getattr(block.feed_forward, n), Float8Linear) for n in ("w1", "w2", "w3"))
    assert "attention keeps bf16 TP styles (wk, wv not converted)" in caplog.text
    assert "feed_forward keeps" not in caplog.text
    pl = placements(model)
    assert pl["layers.0.attention.wk.weight"] == (Shard(0),)
    assert pl["layers.0.feed_forward.w2.weight"] == (Shard(1),)


def test_fsdp_bf16_casts_block_inputs_but_not_the_rope_table(fake_world):
    # FSDP's mixed-precision policy casts a block's floating-point inputs to bf16; the complex table is
    # left alone, so no block keeps a bf16 copy of it and the eager RoPE takes its complex path.
    fake_world(2)
    model = parallel(2, dp_shard=2, precision="bf16")
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    seen = {}

    def grab(module, args):
        seen["x"], seen["rope"] = args[0].dtype, args[1].dtype

    model.layers["1"].attention.register_forward_pre_hook(grab)
    with torch.no_grad():
        model(torch.randint(0, 8192, (2, 16)))  # a fake world: values are garbage, dtypes are real
    assert seen == {"x": torch.bfloat16, "rope": torch.complex64}


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
        apply_ac(model, mode="selective", selective="op", op_matmuls="alternate", op_all_last=op_all_last)
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


def test_compile_workers_take_the_ranks_share_of_the_cores_and_start_at_launch(monkeypatch):
    import os

    from torch._inductor import async_compile
    from torch._inductor import config as inductor_config

    from titanrush.parallel.compile import start_compile_workers

    started, woken = [], []
    pool = async_compile.AsyncCompile
    monkeypatch.setattr(
        pool, "warm_pool", classmethod(lambda cls: started.append(inductor_config.compile_threads))
    )
    monkeypatch.setattr(pool, "wakeup", classmethod(lambda cls: woken.append(True)))
    monkeypatch.setattr(inductor_config, "compile_threads", 7)
    triton = [True]  # a CUDA build's Triton
    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: triton[0])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.delenv("TORCH_WARM_POOL", raising=False)

    assert start_compile_workers(-1, ranks_per_host=4) is None  # inductor's own choice: nothing touched
    assert inductor_config.compile_threads == 7 and started == []
    assert start_compile_workers(0, ranks_per_host=4) == 16  # 64 cores over 4 ranks
    assert started == [16] and len(woken) == 1  # the pool and its workers started now
    assert start_compile_workers(0, ranks_per_host=1) == 32  # capped as inductor caps it
    assert start_compile_workers(3, ranks_per_host=4) == 3 and inductor_config.compile_threads == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert start_compile_workers(0, ranks_per_host=2) == 1  # one core each: inductor compiles in process
    assert started == [16, 32, 3]  # no pool to start for a single worker
    triton[0] = False  # a CPU build: the count is set, no pool is started
    assert start_compile_workers(4, ranks_per_host=1) == 4 and started == [16, 32, 3]
    triton[0] = True
    monkeypatch.setenv("TORCH_WARM_POOL", "0")  # inductor's switch for not starting the pool early
    assert start_compile_workers(4, ranks_per_host=1) == 4 and started == [16, 32, 3]
    monkeypatch.delenv("TORCH_WARM_POOL")
    # The user's variable wins: inductor read it at import (here: set as it would have), nothing is changed.
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "5")
    monkeypatch.setattr(inductor_config, "compile_threads", 5)
    assert start_compile_workers(0, ranks_per_host=4) == 5 and inductor_config.compile_threads == 5
    assert started == [16, 32, 3, 5]


@pytest.mark.parametrize("world", [2, 4])
def test_copy_in_by_chunks_writes_what_chunk_cat_writes(world):
    from titanrush.parallel.fsdp import COPY_IN_CALLS, reduce_scatter_copy_in

    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 12), (4,), (16, 3, 2), (12, 8)]  # matrices, a norm, a 3-d weight
    for grad_dtype, reduce_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in shapes]
        n = sum(g.numel() for g in grads)
        ref, out = torch.empty(n, dtype=reduce_dtype), torch.full((n,), float("nan"), dtype=reduce_dtype)
        torch._chunk_cat(grads, 0, world, out=ref.view(world, -1))
        before = dict(COPY_IN_CALLS)
        reduce_scatter_copy_in(grads, out, world)
        assert torch.equal(out, ref), (grad_dtype, world)
        assert COPY_IN_CALLS["by_chunks"] == before["by_chunks"] + 1
    # A dim 0 that needs FSDP's zero padding (6 rows over 4 ranks) takes chunk_cat, which pads.
    grads = [torch.randn(6, 2, generator=gen), torch.randn(8, generator=gen)]
    padded = 8 * 2 + 8
    ref, out = torch.empty(padded), torch.full((padded,), float("nan"))
    torch._chunk_cat(grads, 0, 4, out=ref.view(4, -1))
    before = dict(COPY_IN_CALLS)
    reduce_scatter_copy_in(grads, out, 4)
    assert torch.equal(out, ref)
    assert COPY_IN_CALLS["chunk_cat"] == before["chunk_cat"] + 1


def test_fsdp_copy_in_is_ours_by_default_and_fsdps_own_when_off(fake_world):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from titanrush.parallel.fsdp import reduce_scatter_copy_in

    fake_world(4)
    try:
        parallel(4, fsdp_copy_in_by_chunks=False)
        assert _fsdp_collectives.foreach_reduce_scatter_copy_in is not reduce_scatter_copy_in
        parallel(4)
        assert _fsdp_collectives.foreach_reduce_scatter_copy_in is reduce_scatter_copy_in
    finally:
        from titanrush.parallel.fsdp import use_copy_in_by_chunks

        use_copy_in_by_chunks(True)


def test_ac_op_all_but_w3_recomputes_one_matmul_per_block():
    base, loss, grad = backward_mms("none")
    n, loss_n, grad_n = backward_mms("selective", "op", op_matmuls="all_but_w3")
    assert n - base == 4  # the 6th matmul (w3) of each of the 4 blocks runs again in backward
    assert loss_n == loss
    torch.testing.assert_close(grad_n, grad, rtol=0, atol=0)
