"""What a compiled float8 block keeps for its backward under FSDP, against the memory estimator.

With FSDP's float8 all-gather, inductor's partitioner keeps the float8 (1 byte) unsharded copies of the
block's FFN weights beside its activations (on H200 and torch 2.11, w1, w3 and w2; the attention's
weights none); without the float8 all-gather it keeps no weight copy. The estimator counts the same
(`memory_model.block_saved`, "float8 FFN weights (all-gathered)"); this test fails when a torch or
torchao version changes what is kept. One GPU: FSDP over a one-rank mesh.
"""

from __future__ import annotations

import os

import pytest
import torch

from titanrush.models.llama import model_args
from titanrush.parallel.compile import CompilePlan
from titanrush.parallel.float8 import Float8Plan
from titanrush.run.memory_model import block_saved
from titanrush.run.plan import RunPlan

KEY = "float8 FFN weights (all-gathered)"


@pytest.fixture(scope="module")
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


def _float8_bytes_kept(mesh, args, all_gather: bool, b: int, t: int) -> int:
    """Bytes of float8 tensors the compiled, FSDP-wrapped block keeps for backward (scales left out)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from titanrush.models.llama.model import TransformerBlock, rope_cache
    from titanrush.parallel.float8 import apply_float8

    torch.manual_seed(0)
    holder = torch.nn.Module()
    with torch.device("cuda"):
        holder.block = TransformerBlock(0, args)
    apply_float8(holder, Float8Plan(enable=True, all_gather=all_gather, filter_fqns=(), min_size=0))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    holder.block.compile(fullgraph=True)
    fully_shard(holder.block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(holder, mesh=mesh, mp_policy=mp)
    x0 = torch.randn(b, t, args.dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    rope = rope_cache(args, t).cuda()
    kept: list[torch.Tensor] = []

    def pack(z: torch.Tensor) -> torch.Tensor:
        kept.append(z)
        return z

    try:
        for step in range(2):  # the second forward: after a backward, as in training
            kept.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda z: z):
                out = holder.block(x0, rope)
            if step == 0:
                out.float().sum().backward()
        storages = {}
        for z in kept:
            inner = (
                [getattr(z, n) for n in z.__tensor_flatten__()[0]]
                if hasattr(z, "__tensor_flatten__")
                else [z]
            )
            for u in inner:
                st = u.untyped_storage()
                if u.dtype == torch.float8_e4m3fn and u.numel() > 1 and st.nbytes():
                    storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())
    finally:
        torch._dynamo.reset()


def test_a_compiled_float8_block_under_fsdp_keeps_the_weight_copies_the_estimator_counts(one_rank_mesh):
    from titanrush.parallel.float8 import float8_supported

    if not float8_supported():
        pytest.skip("float8 needs compute capability 8.9+ and torchao")
    args = model_args("8B")  # one block of the 8B (dim 4096, FFN 14336) at seq 8192
    b, t = 1, 8192

    def estimated(all_gather: bool) -> int:
        f8 = Float8Plan(enable=True, all_gather=all_gather, filter_fqns=(), min_size=0)
        s = RunPlan(args=args, local_batch=b, seq_len=t, float8=f8, compile=CompilePlan(enable=True))
        return block_saved(s, b * t, b, "compiled").get(KEY, 0)

    assert estimated(True) == 3 * args.dim * args.ffn_hidden and estimated(False) == 0
    assert _float8_bytes_kept(one_rank_mesh, args, True, b, t) == estimated(True)
    assert _float8_bytes_kept(one_rank_mesh, args, False, b, t) == 0
