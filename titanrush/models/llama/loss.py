"""Cross-entropy losses: the plain one over full logits, a chunked one that never holds them all, and
loss parallel's over logits sharded by vocabulary (`vocab_parallel_cross_entropy_sum`, at the end).

The chunked loss fuses the output projection with the loss and computes both gradients in forward, one
chunk of tokens at a time: per chunk, the logits, the loss and the logits' gradient (softmax minus the
one-hot label), then that gradient's products with the weight (the hidden states' gradient) and with the
chunk's hidden states (added to the weight's gradient, accumulated in fp32). Backward only scales the two
gradients it kept. No (tokens, vocabulary) tensor outlives its chunk and no matmul runs twice: the plain
loss keeps the logits for backward and then allocates their gradient beside them, two (tokens,
vocabulary) tensors at the peak; the chunked loss keeps one fp32 copy of the weight's gradient instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100  # F.cross_entropy's default: labels with this value add nothing to the loss


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits (B, T, V) against labels (B, T), computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy of logits (B, T, V) against labels (B, T), in fp32; labels equal to
    IGNORE_INDEX add nothing. The trainer divides it by the step's global count of valid tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count (are not IGNORE_INDEX), as a 0-dim int64 tensor on the labels' device."""
    return (labels != IGNORE_INDEX).sum()


def loss_divisor(labels: list[torch.Tensor], *, group: Any = None, averaged_over: int = 1) -> torch.Tensor:
    """The divisor of every loss sum of one optimizer step (a 0-dim fp32 tensor; no host sync).

    The step's valid tokens, over its micro-batches (`labels`) and summed over `group` (the data-parallel
    ranks; None: this process alone), divided by `averaged_over`, the number of ranks whose gradients the
    reduction averages (dp x cp under FSDP/DDP). Each rank's loss sum divided by it gives, once averaged,
    the gradient of the mean over every valid token of the step, however the masked labels fall across
    micro-batches and ranks. One all-reduce of a count.
    """
    count = torch.stack([valid_tokens(x) for x in labels]).sum()
    if group is not None:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count.clamp_min(1).float() / averaged_over


def chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy of the chunk, d(loss * scale)/d(logits) in the logits' dtype), math in fp32.

    Compiled, this becomes row-wise kernels that read the logits twice and write the gradient once.
    Eager, the fp32 copy of the logits becomes the gradient in place (fp32 logits are overwritten): one
    (rows, V) fp32 buffer and no other.
    """
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0).unsqueeze(1)  # other negative labels fail in gather, as in F
    row_scale = (scale * valid).to(lf.dtype).unsqueeze(1)  # 0 for ignored tokens
    target_logit = lf.gather(1, target)
    if torch.compiler.is_compiling():
        lse = torch.logsumexp(lf, dim=1, keepdim=True)
        cols = torch.arange(lf.shape[1], device=lf.device).unsqueeze(0)
        p = torch.exp(lf - lse)
        grad = torch.where(cols == target, p - 1.0, p) * row_scale
    else:
        row_max = lf.amax(1, keepdim=True)
        grad = lf.sub_(row_max).exp_()  # exp(logit - max), in place
        sum_exp = grad.sum(1, keepdim=True)
        lse = row_max + sum_exp.log()
        grad.mul_(row_scale / sum_exp).scatter_add_(1, target, -row_scale)  # (softmax - one-hot) * scale
    loss_sum = ((lse - target_logit).squeeze(1) * valid).sum()
    return loss_sum, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return torch.compile(chunk_loss_and_grad, dynamic=False)


def _chunk_fn(compiled: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return _compiled_chunk() if compiled else chunk_loss_and_grad


def _add_weight_grad(dw: torch.Tensor | None, grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dw + grad.T @ h, dw in fp32 for bf16/fp16 gradients. On CUDA, cuBLAS adds the bf16 product into the
    fp32 sum itself (no low-precision copy of the product, no extra kernel); elsewhere the product is
    cast and added."""
    if grad.dtype not in (torch.bfloat16, torch.float16):  # fp32, fp64: summed in their own dtype
        return grad.t() @ h if dw is None else dw.addmm_(grad.t(), h)
    if grad.is_cuda:
        if dw is None:
            return torch.mm(grad.t(), h, out_dtype=torch.float32)
        return torch.addmm(dw, grad.t(), h, out_dtype=torch.float32, out=dw)
    part = (grad.t() @ h).float()
    return part if dw is None else dw.add_(part)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_size, compiled):  # type: ignore[override]
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        with torch.autocast(dev, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)  # under autocast: its bf16 copies, once
            n_valid = (labels != IGNORE_INDEX).sum().clamp_min(1)
            math_dtype = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
            scale = 1.0 / n_valid.to(math_dtype)
            fn = _chunk_fn(compiled)
            total = torch.zeros((), dtype=math_dtype, device=h.device)
            dh = torch.empty_like(hc)
            dw = None
            for start in range(0, hc.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                loss_sum, grad = fn(hc[rows] @ wc.t(), labels[rows], scale)
                total += loss_sum
                torch.mm(grad, wc, out=dh[rows])
                dw = _add_weight_grad(dw, grad, hc[rows])
                del grad
            # Kept until backward in the weight's dtype (bf16 under FSDP's mixed precision: half the
            # memory), which is what backward did first anyway: cast, then scale the cast copy.
            dw = dw.to(weight.dtype)
        ctx.save_for_backward(dh, dw)
        ctx.h_dtype = h.dtype
        return total * scale

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        dh, dw = ctx.saved_tensors
        return (dh * g).to(ctx.h_dtype), dw * g, None, None, None


def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, *, compiled: bool = False
) -> torch.Tensor:
    """Mean cross-entropy of the output projection h @ weight.T against labels, chunk by chunk.

    h (..., D), weight (V, D), labels (...) with IGNORE_INDEX for tokens that do not count. Equals
    `cross_entropy(h @ weight.T, labels)` and its gradients; at most one chunk of (chunk_size, V) logits
    and their gradient exist at a time. `compiled`: torch.compile the per-chunk loss and gradient.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    h, labels = h.flatten(0, -2), labels.flatten()
    if not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        return _chunked_loss_only(h, weight, labels, chunk_size)
    return _LinearCrossEntropy.apply(h, weight, labels, chunk_size, compiled)


def _chunked_loss_only(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """The chunked loss without gradients (validation): the same chunks and fp32 math, no gradient work."""
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    for start in range(0, h.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        total += cross_entropy_sum((h[rows] @ weight.t()).unsqueeze(0), labels[rows].unsqueeze(0))
    return total / valid_tokens(labels).clamp_min(1)


# Rows of fp32 math per chunk: about 2**26 elements (256 MiB) whatever the vocabulary shard.
LOSS_CHUNK_ELEMENTS = 2**26


def vocab_parallel_cross_entropy_sum(logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
    """Loss parallel: the summed token cross-entropy of logits (B, T, V) sharded over the vocabulary (a
    DTensor, Shard(-1) on the tensor-parallel mesh) against labels (B, T), the same on every rank; labels
    equal to IGNORE_INDEX add nothing. A plain 0-dim fp32 tensor, the same on every tp rank; its gradient
    reaches each rank's logits shard only.

    Three all-reduces of one number per token (the row maximum, the sum of exponentials, the label's
    logit, held by one rank); the fp32 math in row chunks; kept for backward: the logits as given and
    14 bytes a row. torch's `loss_parallel()` runs an eager fp32 log-softmax that keeps (tokens,
    vocab / tp) fp32 tensors (7 GiB on the 8B at 16k tokens), and compiled it gave a wrong loss once
    inductor's cache was warm (95.7 against 132.9; torch 2.13, CPU, 2 ranks).
    """
    mesh = logits.device_mesh
    width = math.ceil(logits.shape[-1] / mesh.size())  # DTensor's Shard: torch.chunk's split
    start = mesh.get_local_rank() * width
    local = logits.to_local()
    return _VocabParallelCrossEntropy.apply(
        local.flatten(0, 1), labels.flatten(0, 1), start, mesh.get_group()
    )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = sum over valid rows of logsumexp(x) - x[label], the row's statistics reduced over the
    vocabulary shards; backward: d/dx = (softmax(x) - onehot(label)) x grad, written per row chunk in the
    logits' dtype. Keeps the logits (as given) and 14 bytes a row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, labels: torch.Tensor, start: int, group: Any) -> torch.Tensor:
        rows = max(1, LOSS_CHUNK_ELEMENTS // max(1, x.shape[-1]))
        local = labels - start
        ours = (local >= 0) & (local < x.shape[-1])
        local = torch.where(ours, local, 0)
        row_max = torch.cat([c.float().amax(-1) for c in x.split(rows)])
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp = torch.cat(
            [(c.float() - m[:, None]).exp().sum(-1) for c, m in zip(x.split(rows), row_max.split(rows))]
        )
        target = torch.where(ours, x.gather(-1, local[:, None]).squeeze(-1).float(), 0.0)
        stats = torch.stack([sum_exp, target])
        dist.all_reduce(stats, group=group)
        lse = row_max + stats[0].log()
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(x, lse, local, ours & valid, valid)
        ctx.rows = rows
        return torch.where(valid, lse - stats[1], 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, lse, local, hit, valid = ctx.saved_tensors
        out = torch.empty_like(x)
        for i in range(0, x.shape[0], ctx.rows):
            end = min(i + ctx.rows, x.shape[0])
            g = (x[i:end].float() - lse[i:end, None]).exp()
            g.scatter_add_(-1, local[i:end, None], -hit[i:end, None].float())
            out[i:end] = (g * (valid[i:end, None] * grad)).to(x.dtype)
        return out, None, None, None
