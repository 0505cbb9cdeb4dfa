"""The clip folded into AdamW (`optimizer.implementation = fused_clip`): its Triton kernel against torch's
fused AdamW after `clip_grads_with_norm_`, its state against torch's, and whole runs against `fused`."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_launch import launch

from titanrush.clip_adamw import ClipAdamW
from titanrush.optim import build_optimizer

SHAPES = [(300, 70), (5000,), (17,), (64, 64), (0,), (3, 1025)]
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1.0


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    scale = 10.0 if step % 2 else 1e-3  # every other step's norm is above MAX_NORM: the clip acts
    return [torch.randn(s, device="cuda", generator=g) * scale for s in SHAPES]


def _step_torch(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    opt.step()


def _step_ours(opt: ClipAdamW, params: list[torch.nn.Parameter], grads: list[torch.Tensor]):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.set_clip(torch.nn.utils.get_total_norm([p.grad for p in params], 2.0), MAX_NORM)
    opt.step()


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):  # (fp32: the two kernels round in their own order)
        torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7)


def test_clip_adamw_steps_as_torch_fused_adamw_after_the_clip():
    ref_p, our_p = _params(), _params()
    ref = torch.optim.AdamW(ref_p, **HYPER, fused=True)
    ours = ClipAdamW(our_p, **HYPER)
    for step in range(6):
        grads = _grads(step)
        _step_torch(ref, ref_p, grads)
        _step_ours(ours, our_p, grads)
        _close(our_p, ref_p)
        # the gradients stay as backward left them (the clip's factor applies inside the kernel)
        assert all(torch.equal(p.grad, g) for p, g in zip(our_p, grads))
    for key in ("exp_avg", "exp_avg_sq"):
        _close([ours.state[p][key] for p in our_p], [ref.state[p][key] for p in ref_p])
    assert [float(ours.state[p]["step"]) for p in our_p] == [6.0] * len(SHAPES)


def test_optimizer_state_moves_between_clip_adamw_and_torch_adamw():
    """A checkpoint of either continues in the other as in itself."""
    a_p, b_p = _params(), _params()
    a, b = ClipAdamW(a_p, **HYPER), torch.optim.AdamW(b_p, **HYPER, fused=True)
    for step in range(3):
        _step_ours(a, a_p, _grads(step))
        _step_torch(b, b_p, _grads(step))
    # swap: torch's AdamW takes ClipAdamW's state, ClipAdamW takes torch's
    c_p = [torch.nn.Parameter(p.detach().clone()) for p in a_p]
    d_p = [torch.nn.Parameter(p.detach().clone()) for p in b_p]
    c, d = torch.optim.AdamW(c_p, **HYPER, fused=True), ClipAdamW(d_p, **HYPER)
    # (copies, as from a checkpoint: load_state_dict keeps tensors already on the right device and dtype)
    c.load_state_dict(copy.deepcopy(a.state_dict()))
    d.load_state_dict(copy.deepcopy(b.state_dict()))
    assert c.param_groups[0]["fused"]  # torch's AdamW keeps its fused kernel with ClipAdamW's groups
    assert all(d.state[p]["step"].device.type == "cpu" for p in d_p)  # read on the host, no wait
    for step in range(3, 6):
        _step_ours(a, a_p, _grads(step))
        _step_torch(c, c_p, _grads(step))
        _step_torch(b, b_p, _grads(step))
        _step_ours(d, d_p, _grads(step))
    _close(c_p, a_p)
    _close(d_p, b_p)


def test_build_optimizer_takes_the_kernel_for_fp32_cuda_parameters_only():
    kw = dict(name="adamw", implementation="fused_clip", **HYPER)
    assert isinstance(build_optimizer(_params(), **kw), ClipAdamW)
    bf16 = [torch.nn.Parameter(torch.randn(8, device="cuda", dtype=torch.bfloat16))]
    opt = build_optimizer(bf16, **kw)
    assert not isinstance(opt, ClipAdamW) and opt.defaults["fused"]


ARGS = [
    "--training.steps",
    "8",
    "--training.seq_len",
    "256",
    "--training.global_batch_size",
    "8",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.max_norm",
    "0.1",  # (below the debug model's gradient norms, 0.2-0.4 in its first steps: the clip acts)
    "--metrics.log_freq",
    "1",
    "--no-metrics.tensorboard",
    "--data.dataset",
    "synthetic",
    "--training.deterministic",
]


def _run(tmp, name: str, ngpu: int, tp: int, impl: str) -> list[dict]:
    mesh = ["--training.local_batch_size", str(8 * tp // ngpu), "--parallelism.tp", str(tp)]
    rows, log = launch(tmp, name, ngpu, [*ARGS, *mesh, "--optimizer.implementation", impl])
    assert "the clip apart" not in log  # (fp32 CUDA parameters: fused_clip takes the kernel)
    return rows


TWO = pytest.mark.multigpu(2)


@pytest.mark.parametrize(
    ("ngpu", "tp"),
    [(1, 1), pytest.param(2, 1, marks=TWO), pytest.param(2, 2, marks=TWO)],
    ids=["one", "fsdp2", "tp2"],
)
def test_a_run_with_the_clip_folded_in_trains_as_one_with_torchs_fused_adamw(tmp_path, ngpu, tp):
    """fp32 (the kernel's parameters; FSDP's sharded DTensors on two GPUs; under TP 2 the replicated norm
    weights' gradients are pending sums, settled before the kernel reads them): the same losses and
    gradient norms, the clip acting, as torch's fused AdamW after its own clip pass."""
    ours = _run(tmp_path, "ours", ngpu, tp, "fused_clip")
    ref = _run(tmp_path, "ref", ngpu, tp, "fused")
    assert max(r["grad_norm"] for r in ref) > 0.1  # the clip acted on some step
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
