"""Llama 4's mixture of experts on one CPU process: the kernels, the routing, the layer against a
per-token reference, load balance, FLOPs from active parameters, and the config rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from titanrush import config
from titanrush.config import ConfigError
from titanrush.metrics import flops_per_token, matmul_params
from titanrush.models.llama4 import Llama4, model_args
from titanrush.models.llama4.balance import balance_experts, moe_modules
from titanrush.models.llama4.grouped_gemm import ALIGN, KERNEL, grouped_mm, loop_mm, pad_groups
from titanrush.models.llama4.moe import MoE
from titanrush.models.llama4.router import Router, add_loss_grad, balance_loss
from titanrush.parallel.activation_checkpoint import ACPlan, SelectiveOpCheckpoint, apply_ac
from titanrush.parallel.expert_parallel import _Permute, regroup_index
from titanrush.run.plan import build_plan


@pytest.mark.parametrize("counts", [[3, 0, 7, 6], [0, 0, 16, 0], [4, 4, 4, 4]])
def test_grouped_gemm_matches_the_loop_forward_and_backward(counts):
    """The grouped kernel (torch.nn.functional.grouped_mm here) against one matmul per expert, empty groups
    included; fp32 on the CPU: the same products summed in the same order, so equal to rounding."""
    gen = torch.Generator().manual_seed(0)
    c = torch.tensor(counts)
    x = torch.randn(int(c.sum()), 32, generator=gen, requires_grad=True)
    w = torch.randn(4, 32, 48, generator=gen, requires_grad=True)
    g = torch.randn(int(c.sum()), 48, generator=gen)
    out = grouped_mm(x, w, c)
    out.backward(g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = loop_mm(x2, w2, c)
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("counts", [[3, 0, 17, 16], [0, 0, 0, 5], [32, 1, 0, 0]])
def test_padded_groups_start_on_tiles_and_give_the_same_product(counts):
    """float8's padding: each group starts at a multiple of 16 in the padded rows, padding rows are zero,
    and the grouped product over the padded groups, read back, is the product over the groups."""
    torch.manual_seed(0)
    c = torch.tensor(counts)
    x = torch.randn(int(c.sum()), 8, requires_grad=True)
    w = torch.randn(4, 8, 5)
    padded, ends, place = pad_groups(x, c)
    assert ends.dtype == torch.int32 and all(int(e) % ALIGN == 0 for e in ends)
    assert padded.shape[0] >= int(ends[-1]) and padded.shape[0] % ALIGN == 0
    assert torch.equal(padded[place], x)
    unused = torch.ones(padded.shape[0], dtype=torch.bool)
    unused[place] = False
    assert torch.count_nonzero(padded[unused]) == 0
    padded_counts = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())
    got = loop_mm(padded[: int(ends[-1])], w, padded_counts)[place]
    ref = loop_mm(x, w, c)
    torch.testing.assert_close(got, ref)
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(got, x, g)
    (rx,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(gx, rx)


def test_float8_experts_refused_without_their_gpu_and_by_the_estimate():
    """On this CPU machine the run is refused before anything is built, and the estimate refuses what it
    does not model."""
    from titanrush.tools.estimate import estimate

    cfg = config.load(
        None, ["--model.flavor", "llama4_debug", "--float8.experts", "--training.precision", "bf16"]
    )
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="float8.experts needs"):
            build_plan(cfg, 1)
    assert build_plan(cfg, 1, machine=False).float8.experts
    with pytest.raises(ConfigError, match="does not count float8 with mixture-of-experts"):
        estimate(cfg, 1, 80.0, trace=False)


def test_the_public_grouped_kernel_is_preferred():
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    assert KERNEL is fn or (fn is None and KERNEL in (None, getattr(torch, "_grouped_mm", None)))


def test_regroup_index_orders_rows_by_expert_then_source_rank():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # rank-major: rank 0 sends 2, 0, 1; rank 1 sends 1, 3, 0
    labels = [(r, e) for r in range(2) for e in range(3) for _ in range(int(counts[r, e]))]
    idx = regroup_index(counts)
    assert [labels[i] for i in idx.tolist()] == sorted(labels, key=lambda re: (re[1], re[0]))
    assert torch.equal(regroup_index(counts, len(labels)), idx)  # (the row count given: no host sync)


def test_the_exchange_permutation_is_differentiable_with_the_inverse_gather():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(7)
    inverse = torch.empty_like(index).scatter_(0, index, torch.arange(7))
    torch.autograd.gradcheck(lambda t: _Permute.apply(t, index, inverse), (x,))
    weight = torch.randn(7, 5, dtype=torch.float64)
    (grad,) = torch.autograd.grad((_Permute.apply(x, index, inverse) * weight).sum(), x)
    (want,) = torch.autograd.grad((x[index] * weight).sum(), x)
    assert torch.equal(grad, want)


def _layer(grouped: bool = True, **kw: object) -> MoE:
    torch.manual_seed(0)
    moe = MoE(32, 24, n_experts=4, top_k=2, grouped=grouped, **kw)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.2)
    return moe


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_matches_a_per_token_reference(grouped):
    """out(t) = shared(x_t) + sum over t's top-k experts e of expert_e(score_e(t) x x_t), the experts
    chosen by score + routing bias; the layer counts each expert's choices of a training pass only."""
    moe = _layer(grouped)
    moe.expert_bias.copy_(torch.tensor([0.3, 0.0, -0.3, 0.1]))  # steers some choices (scores are in (0, 1))
    x = torch.randn(2, 5, 32)
    out = moe(x)
    tokens = x.reshape(-1, 32)
    scores = torch.sigmoid(tokens @ moe.router.gate.weight.T)
    chosen = torch.topk(scores + moe.expert_bias, 2).indices  # (10, 2)
    assert not torch.equal(chosen.sort().values, torch.topk(scores, 2).indices.sort().values)  # (bias used)
    w13, w2 = moe.experts.w13, moe.experts.w2
    for t, tok in enumerate(tokens):
        expect = moe.shared_expert(tok)
        for e in chosen[t].tolist():
            gate, up = (scores[t, e] * tok @ w13[e]).chunk(2)
            expect = expect + (torch.nn.functional.silu(gate) * up) @ w2[e]
        torch.testing.assert_close(out.reshape(-1, 32)[t], expect, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(chosen.flatten(), minlength=4)
    assert moe.tokens_per_expert.tolist() == counts.tolist()
    with torch.no_grad():
        moe(x)
    assert moe.tokens_per_expert.tolist() == counts.tolist()  # validation passes are not counted
    moe(x)
    assert moe.tokens_per_expert.tolist() == (2 * counts).tolist()  # micro-batches add up


def test_bias_steers_the_choice_but_not_the_weights():
    torch.manual_seed(0)
    router = Router(16, 4, top_k=1)
    x = torch.randn(64, 16)
    plain = router(x)
    best = torch.argmax(x @ router.gate.weight.T, dim=-1)  # sigmoid is monotonic: the largest logit
    assert plain.counts.tolist() == torch.bincount(best, minlength=4).tolist()
    assert plain.counts[0] < 64  # (so that the bias below changes choices)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])  # beyond any sigmoid score: every token picks expert 0
    steered = router(x, bias)
    assert steered.counts.tolist() == [64, 0, 0, 0]
    torch.testing.assert_close(steered.weights[:, 0], plain.scores[:, 0])


def test_balance_loss_is_one_when_balanced_and_more_when_skewed():
    router = Router(8, 4, top_k=1)
    nn.init.zeros_(router.gate.weight)  # every score 0.5: the normalized scores are uniform
    x = torch.randn(2 * 8, 8)
    balanced = router(x, torch.tensor([0.0, 0.0, 0.0, 0.0]), n_seqs=2)
    balanced.seq_counts = torch.full((2, 4), 2.0)  # each expert 2 tokens per sequence
    assert balance_loss(balanced).item() == pytest.approx(1.0)
    skewed = router(x, torch.tensor([1.0, 0.0, 0.0, 0.0]), n_seqs=2)
    assert skewed.seq_counts.tolist() == [[8, 0, 0, 0], [8, 0, 0, 0]]
    assert balance_loss(skewed).item() == pytest.approx(1.0)  # uniform scores: P_e = 1/4
    router.gate.weight.data[0] = 1.0
    skewed = router(x.abs(), torch.tensor([1.0, 0.0, 0.0, 0.0]), n_seqs=2)  # expert 0 scores highest
    assert balance_loss(skewed).item() > 1.4


def test_balance_loss_of_sequence_shards_sums_to_the_whole_sequences():
    """Under sequence (or context) parallel each rank routes a shard of every sequence: with the counts
    per sequence summed over the shards, the shards' losses average to the whole sequences' loss, in
    value and in gradient."""
    torch.manual_seed(0)
    router = Router(8, 4, top_k=1)
    x = torch.randn(2, 12, 8)  # (B, T, dim)
    whole = router(x.reshape(-1, 8), n_seqs=2)
    loss = balance_loss(whole)
    (grad,) = torch.autograd.grad(loss, router.gate.weight)
    shards = [router(part.reshape(-1, 8), n_seqs=2) for part in x.chunk(3, dim=1)]
    total = sum(s.seq_counts for s in shards)
    for s in shards:
        s.seq_counts = total
    sharded = sum(balance_loss(s) for s in shards) / 3
    torch.testing.assert_close(sharded, loss)
    torch.testing.assert_close(torch.autograd.grad(sharded, router.gate.weight)[0], grad)


def test_added_loss_has_the_gradient_of_a_loss_added_to_the_total():
    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    out = add_loss_grad(a * 2, (b**2).sum() * 0.3)
    out.sum().backward()
    torch.testing.assert_close(a.grad, torch.full((5,), 2.0))
    torch.testing.assert_close(b.grad, 0.3 * 2 * b.detach())


def test_router_losses_reach_the_gate_only_through_their_weight():
    x = torch.randn(2, 6, 32)
    grads = {}
    for name, kw in {"none": {}, "aux": {"aux_loss_weight": 0.5}, "z": {"z_loss_weight": 0.5}}.items():
        moe = _layer(**kw)
        moe(x).sum().backward()
        grads[name] = (moe.router.gate.weight.grad.clone(), moe.experts.w2.grad.clone())
    for name in ("aux", "z"):
        assert not torch.allclose(grads[name][0], grads["none"][0])  # the router learns from the loss
        torch.testing.assert_close(grads[name][1], grads["none"][1])  # the experts do not


def test_bias_update_balances_a_skewed_router():
    """A synthetic task: a MoE layer learns a random linear teacher while its router starts skewed (most
    tokens prefer expert 0). With the bias update the load evens out; without it, it stays skewed."""

    def train(rate: float) -> float:
        torch.manual_seed(0)
        moe = MoE(16, 16, n_experts=8, top_k=1)
        for p in moe.parameters():
            nn.init.normal_(p, std=0.1)
        with torch.no_grad():
            moe.router.gate.weight[0] += 0.3  # inputs are positive: expert 0 wins most tokens
        teacher = torch.randn(16, 16) * 0.1
        opt = torch.optim.Adam(moe.parameters(), lr=1e-3)
        moes = {"0": moe}
        load = torch.zeros(8)
        for step in range(150):
            x = torch.rand(4, 32, 16)
            loss = (moe(x) - x @ teacher).square().mean()
            opt.zero_grad()
            loss.backward()
            stats = balance_experts(moes, rate=rate)
            opt.step()
            if step >= 100:  # the load of the last 50 steps (one step's 128 tokens are a noisy sample)
                load += torch.tensor(stats["moe_share_l0"])
        return (load.max() / load.mean()).item(), stats["moe_imbalance"]

    (skewed, first), (balanced, _) = train(0.0), train(0.01)
    assert skewed > 4.0 and first > 4.0, (skewed, first)
    assert balanced < 1.3, balanced


def test_balance_reports_counts_and_resets():
    """The reported tokens per expert are the router's top-k choices over the batch, counted here from the
    gate's scores; the imbalance is their max over their mean."""
    moe = _layer()
    x = torch.randn(2, 5, 32)
    moe(x)
    chosen = torch.topk(torch.sigmoid(x.reshape(-1, 32) @ moe.router.gate.weight.T), 2).indices
    counts = torch.bincount(chosen.flatten(), minlength=4)
    stats = balance_experts({"3": moe}, rate=0.0, routed_tokens=20)
    assert stats["moe_tokens_l3"] == counts.tolist()
    assert stats["moe_imbalance"] == pytest.approx(counts.max().item() / counts.float().mean().item())
    assert moe.tokens_per_expert.sum() == 0 and moe.expert_bias.abs().sum() == 0  # rate 0: measured only


def _one_hot_router_moe(expert_of_position: list[int]) -> MoE:
    """A top-1 layer whose token with a one at position j (of 8) goes to expert_of_position[j]."""
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=4, top_k=1)
    with torch.no_grad():
        for p in moe.parameters():
            nn.init.normal_(p, std=0.2)
        moe.router.gate.weight.fill_(-5.0)
        for j, e in enumerate(expert_of_position):
            moe.router.gate.weight[e, j] = 5.0
    return moe


def test_imbalance_is_one_for_an_even_router_and_e_for_one_taking_all_and_the_bias_pushes_back():
    """8 one-hot tokens: sent two to each expert the imbalance is 1.0 and no bias moves; all sent to
    expert 0, it is E = 4, and the update lowers expert 0's bias by the rate and raises the idle ones',
    re-centred to mean zero: rate x ([-1, 1, 1, 1] - 0.5)."""
    x = torch.eye(8).reshape(1, 8, 8)
    even = _one_hot_router_moe([0, 1, 2, 3, 0, 1, 2, 3])
    even(x)
    stats = balance_experts({"0": even}, rate=0.1)
    assert stats["moe_share_l0"] == [0.25] * 4 and stats["moe_imbalance"] == pytest.approx(1.0)
    assert even.expert_bias.tolist() == [0.0] * 4
    skewed = _one_hot_router_moe([0] * 8)
    skewed(x)
    stats = balance_experts({"0": skewed}, rate=0.1)
    assert stats["moe_share_l0"] == [1.0, 0.0, 0.0, 0.0] and stats["moe_imbalance"] == pytest.approx(4.0)
    torch.testing.assert_close(skewed.expert_bias, torch.tensor([-0.15, 0.05, 0.05, 0.05]))
    skewed(x)  # still all to expert 0 (scores 0.99 vs 0.01): the update adds up
    balance_experts({"0": skewed}, rate=0.1)
    torch.testing.assert_close(skewed.expert_bias, torch.tensor([-0.3, 0.1, 0.1, 0.1]))


def test_a_skipped_step_moves_no_routing_bias_and_stats_wait_for_the_log():
    from titanrush.models.llama4.balance import ExpertBalance

    moe = _layer()
    balance = ExpertBalance([], rate=0.1)
    balance.moes = {"0": moe}  # (one layer, without a model around it)
    moe(torch.randn(2, 5, 32))
    balance.step(update=False)  # a step skipped as non-finite: counted and reset, no bias moved
    assert moe.expert_bias.abs().sum() == 0 and moe.tokens_per_expert.sum() == 0
    assert sum(balance.stats()["moe_share_l0"]) == pytest.approx(1.0)
    moe(torch.randn(2, 5, 32))
    balance.step()
    assert moe.expert_bias.abs().sum() > 0


def test_window_imbalance_sums_the_load_of_every_step_since_the_last_log():
    """Two steps, each sending every token to one of 4 experts (4.0 per step), to experts 0 then 1: over
    the window the two experts share the load (max / mean = 2.0); the next window starts empty."""
    from titanrush.models.llama4.balance import ExpertBalance

    moe = MoE(32, 24, n_experts=4, top_k=1)
    nn.init.normal_(moe.router.gate.weight, std=0.2)
    balance = ExpertBalance([], rate=0.0)
    balance.moes = {"0": moe}
    for expert in (0, 1):
        moe.expert_bias.zero_()[expert] = 10.0  # (scores are in (0, 1): the bias decides)
        moe(torch.randn(2, 5, 32))
        balance.step()
    stats = balance.stats()
    assert stats["moe_imbalance"] == pytest.approx(4.0) and stats["moe_share_l0"][1] == pytest.approx(1.0)
    assert stats["moe_imbalance_window"] == pytest.approx(2.0) == stats["moe_imbalance_window_mean"]
    moe(torch.randn(2, 5, 32))
    balance.step()
    assert balance.stats()["moe_imbalance_window"] == pytest.approx(4.0)  # one step: expert 1 alone


@pytest.mark.parametrize("op_matmuls", ["all", "alternate"])
def test_op_checkpointing_by_parts_wraps_the_attention_router_and_shared_expert_only(op_matmuls):
    """Per-op checkpointing by parts (a MoE layer with FSDP units of its own, under EP or TP): the block
    itself and the experts stay unwrapped, the checkpoint's names and the step's numbers those of the
    model without checkpointing."""
    args = dataclasses.replace(model_args("llama4_debug"), n_layers=2, aux_loss_weight=0.01)
    plain, parts = Llama4(args), Llama4(args)
    for m in (plain, parts):
        m.init_weights(seed=0)
    apply_ac(parts, ACPlan(mode="selective", op_matmuls=op_matmuls, moe_by_parts=True))
    for block in parts.layers.values():
        assert type(block).__name__ == "Llama4Block" and isinstance(block.attention, SelectiveOpCheckpoint)
        assert isinstance(block.moe.router, SelectiveOpCheckpoint) and block.moe.router.op_matmuls == "all"
        assert isinstance(block.moe.shared_expert, SelectiveOpCheckpoint)
        assert (
            block.attention.op_matmuls == op_matmuls and type(block.moe.experts).__name__ == "GroupedExperts"
        )
    assert list(parts.state_dict()) == list(plain.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    for m in (plain, parts):
        m(tokens).float().square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), parts.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_dense_and_moe_checkpoints_are_named_incompatible_and_not_taken_as_a_shape(tmp_path):
    import dataclasses
    import json

    from titanrush.checkpoint.compat import model_arg_differences
    from titanrush.interop import hf
    from titanrush.models.llama import model_args as dense_args

    dense, moe = dataclasses.asdict(dense_args("debug")), dataclasses.asdict(model_args("llama4_debug"))
    assert model_arg_differences(moe, dense) == [
        "the model is a Llama 4 mixture-of-experts model there, a dense Llama here"
    ]
    other = {**moe, "top_k": moe["top_k"] + 1, "grouped_mm": not moe["grouped_mm"]}
    hidden = model_args("llama4_debug", top_k=2).expert_hidden, model_args("llama4_debug").expert_hidden
    assert hidden[0] != hidden[1]  # (the experts' width follows top_k where moe_hidden is 0)
    assert model_arg_differences(other, moe) == [
        f"top_k is {moe['top_k'] + 1} there, {moe['top_k']} here",
        f"the experts' hidden size (moe_hidden) is {hidden[0]} there, {hidden[1]} here",
    ]
    fixed = {**moe, "moe_hidden": 128}
    assert model_arg_differences({**fixed, "multiple_of": 32}, fixed) == []  # (only through the widths)
    assert model_arg_differences({**moe, "multiple_of": 96}, moe)  # the derived expert width changes
    (tmp_path / "titanrush.json").write_text(json.dumps({"flavor": "llama4_debug", "model_args": moe}))
    assert hf.model_args_at(tmp_path) == dataclasses.replace(model_args("llama4_debug"), grouped_mm=True)
    cfg = config.load(None, ["--model.flavor", "custom", "--model.from_checkpoint", str(tmp_path)])
    with pytest.raises(ConfigError, match="holds a Llama 4 .*dense Llamas only"):
        build_plan(cfg, 1, machine=False)


def test_flops_per_token_counts_active_parameters_as_torchs_flop_counter():
    """Against torch's FlopCounterMode over forward and backward, with the per-expert loop (whose matmuls
    it counts: tokens_e x expert parameters, summed = tokens x top_k x one expert), chunked attention on
    the RoPE layers and full attention on the NoPE ones."""
    from torch.utils.flop_counter import FlopCounterMode

    args = model_args(
        "llama4_debug", attn_backend="math", grouped_mm=False, attn_chunk=32, nope_every=2, top_k=2
    )
    model = Llama4(args)
    model.init_weights(seed=0)
    batch, seq = 2, 96
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert counter.get_total_flops() == flops_per_token(args, matmul_params(model), seq) * batch * seq
    dense = sum(p.numel() for n, p in model.named_parameters() if p.dim() > 1 and "tok_embeddings" not in n)
    assert matmul_params(model) < dense  # 2 of 8 experts per token


def test_llama4_blocks_interleave_and_weights_are_deterministic():
    args = model_args("llama4_debug", moe_every=2, nope_every=4)
    with torch.device("meta"):
        model = Llama4(args)
    kinds = ["moe" if b.moe is not None else "dense" for b in model.layers.values()]
    assert kinds == ["dense", "moe", "dense", "moe"]
    assert [b.attention.rope for b in model.layers.values()] == [True, True, True, False]
    assert list(moe_modules([model])) == ["1", "3"]
    a, b = Llama4(args), Llama4(args)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def plan_of(world: int, *over: str):
    return build_plan(config.load(None, ["--model.flavor", "llama4_debug", *over]), world, machine=False)


def test_plan_resolves_moe_decisions():
    plan = plan_of(
        4, "--parallelism.ep", "2", "--moe.aux_loss_coeff", "0.01", "--training.global_batch_size", "64"
    )
    assert plan.ep == 2 and plan.dims.ep == 2 and plan.moe
    assert plan.args.aux_loss_weight == pytest.approx(0.01 / plan.accum) and plan.accum == 2
    assert "router.gate" in plan.float8.filter_fqns
    compiled = plan_of(4, "--parallelism.ep", "2", "--compile.enable")
    assert not compiled.compile.fullgraph  # the all-to-all's splits are host values: graph breaks there
    assert plan_of(1, "--compile.enable", "--training.precision", "bf16").compile.fullgraph
    assert not plan_of(1, "--compile.enable").compile.fullgraph  # fp32: the per-expert loop
    # TP with sequence parallel: each tp rank routes 1/tp of the tokens, and the router's gradients are
    # summed over them: both losses weigh 1/tp on each; without sequence parallel every rank routes all
    losses = ("--moe.z_loss_coeff", "0.004", "--moe.aux_loss_coeff", "0.01")
    sp = plan_of(2, "--parallelism.tp", "2", *losses).args
    assert (sp.z_loss_weight, sp.aux_loss_weight) == (pytest.approx(0.002), pytest.approx(0.005))
    no_sp = plan_of(2, "--parallelism.tp", "2", "--no-parallelism.sequence_parallel", *losses)
    assert no_sp.moe_tp and no_sp.args.z_loss_weight == pytest.approx(0.004)
    assert no_sp.args.aux_loss_weight == pytest.approx(0.01)


@pytest.mark.parametrize(
    "world, over, match",
    [
        (2, ["--model.flavor", "debug", "--parallelism.ep", "2"], "has no experts"),
        (1, ["--model.flavor", "8B", "--moe.aux_loss_coeff", "0.05"], "has no experts"),
        (4, ["--parallelism.ep", "3"], "must divide dp_shard"),
        (1, ["--parallelism.ep", "2"], r"needs at least 2 processes.* has 1\): launch with NGPU=2"),
        (
            4,
            ["--parallelism.cp", "2", "--parallelism.tp", "2"],
            r"parallelism.cp = 2 does not compose .*tp = 2",
        ),
        (
            1,
            [
                "--model.flavor",
                "llama4_17Bx16E",
                "--training.seq_len",
                "12288",
                "--training.local_batch_size",
                "1",
            ],
            "multiple of",
        ),
        (1, ["--moe.bias_update_rate", "-1"], "moe.bias_update_rate must be"),
        (1, ["--moe.bias_update_rate", "1"], r"moe\.bias_update_rate must be in \[0.0, 1.0\).*sigmoids"),
        (1, ["--parallelism.ep", "0"], "parallelism.ep must be"),
        (1, ["--model.flavor", "debug", "--float8.experts"], "float8.experts needs a Llama 4"),
        (1, ["--float8.experts"], "runs on bf16 training .* this run has training.precision = 'fp32'"),
    ],
)
def test_moe_config_rules(world, over, match):
    with pytest.raises(ConfigError, match=match):
        build_plan(config.load(None, ["--model.flavor", "llama4_debug", *over]), world, machine=False)


@pytest.mark.parametrize(
    "world, over",
    [
        (2, ["--parallelism.tp", "2", "--float8.enable"]),
        (2, ["--parallelism.tp", "2", "--float8.experts"]),
        (2, ["--parallelism.pp", "2", "--float8.experts"]),
        (2, ["--parallelism.cp", "2", "--float8.experts"]),
    ],
    ids=["tp2_float8", "tp2_float8_experts", "pp2_float8_experts", "cp2_float8_experts"],
)
def test_moe_compositions_proven_on_gpus_are_planned(world, over):
    """Tested on GPUs (tests/gpu/test_moe_gpu.py), so planned like any other mesh."""
    args = ["--model.flavor", "llama4_debug", "--training.precision", "bf16", *over]
    plan = build_plan(config.load(None, args), world, machine=False)
    degrees = {"tp": plan.dims.tp, "pp": plan.dims.pp, "cp": plan.dims.cp}
    assert degrees == {d: 2 if f"--parallelism.{d}" in over else 1 for d in degrees}
    assert plan.float8.experts == ("--float8.experts" in over)
    assert plan.float8.enable == ("--float8.enable" in over)


def test_experts_must_divide_over_ep():
    with pytest.raises(ConfigError, match="must divide the llama4_debug model.s 6 experts"):
        args = dataclasses.replace(model_args("llama4_debug"), n_experts=6)
        from titanrush.run import validate

        cfg = config.load(None, ["--model.flavor", "llama4_debug", "--parallelism.ep", "4"])
        plan = plan_of(4, "--parallelism.ep", "4")
        validate.check_run(cfg, plan.dims, args)


def test_llama4_debug_trains_through_the_trainer(tmp_path):
    """The normal trainer on CPU: the loss falls and every logged row carries the experts' load (the
    step's tokens per expert over all ranks, summing to the step's tokens x top_k)."""
    import json

    from titanrush.trainer import Trainer

    args = [
        "--model.flavor",
        "llama4_debug",
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "20",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--moe.bias_update_rate",
        "0.01",
    ]
    cfg = config.load(None, args)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:  # the held-out loss on the same batches before and after (one training batch is a noisy sample)
        before = trainer.validate()
        trainer.train()
        after = trainer.validate()
    finally:
        trainer.close()
    assert after < before - 0.5, (before, after)  # measured 9.38 -> 8.66 (the dense debug model: 8.54)
    rows = [json.loads(x) for x in (tmp_path / "llama4_debug" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 21))
    moes = moe_modules(trainer.model_parts)
    assert list(moes) == ["0", "1", "2", "3"]
    for layer, moe in moes.items():
        # Every layer is MoE, 4 x 64 tokens per step, top-1. The logged counts are the ones that moved the
        # routing bias: replaying the update rule on them gives the model's bias after the run.
        counts = torch.tensor([r[f"moe_tokens_l{layer}"] for r in rows], dtype=torch.float64)  # (steps, E)
        assert counts.shape == (20, 8) and (counts.sum(-1) == 256).all(), counts
        for r, c in zip(rows, counts):
            assert r[f"moe_imbalance_l{layer}"] == pytest.approx((c.max() / c.mean()).item())
        sign = torch.sign(counts.mean(-1, keepdim=True) - counts)
        bias = 0.01 * (sign - sign.mean(-1, keepdim=True)).sum(0)
        assert bias.abs().max() > 0.005, bias  # (the load was uneven: the bias moved)
        torch.testing.assert_close(moe.expert_bias.double(), bias, rtol=0, atol=1e-5)
    for r in rows:
        assert r["moe_imbalance_window"] == pytest.approx(r["moe_imbalance"])  # logged every step
    assert (tmp_path / "llama4_debug" / "tb").is_dir()


def test_chunked_attention_is_causal_attention_within_each_chunk():
    """Folding the chunks into the batch equals attention under the chunked causal mask (query i sees key
    j when j <= i and both are in the same chunk), written out here with an explicit mask."""
    from titanrush.models.llama.model import apply_rope, rope_cache
    from titanrush.models.llama4.model import Llama4Attention

    args = model_args("llama4_debug", attn_chunk=8)
    attn = Llama4Attention(args, rope=True)
    x = torch.randn(2, 24, args.dim)
    rope = rope_cache(args, 64)
    out = attn(x, rope)
    q = apply_rope(attn.wq(x).view(2, 24, 8, -1), rope[:24]).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, 24, 4, -1), rope[:24]).repeat_interleave(2, dim=2).transpose(1, 2)
    v = attn.wv(x).view(2, 24, 4, -1).repeat_interleave(2, dim=2).transpose(1, 2)
    i = torch.arange(24)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] // 8 == i[:, None] // 8)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, attn.wo(ref.transpose(1, 2).reshape(2, 24, -1)), rtol=1e-5, atol=1e-5)
    nope = Llama4Attention(args, rope=False)  # NoPE layers: the whole sequence, no rotation
    assert nope.chunk == 0 and not nope.rope


@pytest.mark.parametrize(
    "blowup, named",
    [
        (["--moe.aux_loss_coeff", "1e30", "--moe.z_loss_coeff", "1e30"], True),
        (["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"], False),
    ],
)
def test_a_non_finite_stop_names_the_moe_loss_coefficients_raised_above_their_defaults(
    tmp_path, capsys, blowup, named
):
    from titanrush import train

    args = ["--model.flavor", "llama4_debug", "--training.steps", "3", "--job.dump_folder", str(tmp_path)]
    args += ["--training.local_batch_size", "2", "--training.seq_len", "32", *blowup]
    assert train.main(args) == 3
    stopped = [x for x in capsys.readouterr().err.splitlines() if x.startswith("titanrush: stopped")]
    assert len(stopped) == 1 and "a lower optimizer.lr" in stopped[0], stopped
    coefficients = "or lower moe.aux_loss_coeff = 1e+30, moe.z_loss_coeff = 1e+30;"
    assert (coefficients in stopped[0]) == named, stopped[0]
