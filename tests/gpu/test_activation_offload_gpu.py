"""Activation offload on a GPU: pinned copies on a side stream give the same gradients, free the offloaded
blocks' memory at the peak, and run through the trainer."""

from __future__ import annotations

import json

import torch

from titanrush import config
from titanrush.models.init import _canonical
from titanrush.models.llama import Llama, model_args
from titanrush.parallel.activation_checkpoint import apply_ac
from titanrush.parallel.activation_offload import apply_offload
from titanrush.parallel.compile import apply_compile
from titanrush.trainer import Trainer


def step(offload_first: int):
    """One compiled bf16 step of an 8-block Llama (1B widths) keeping every matmul output: loss, gradients,
    peak allocated bytes over forward and backward, bytes offloaded."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    args = model_args("1B", n_layers=8, vocab_size=8192, tie_embeddings=False)
    with torch.device("meta"):
        model = Llama(args)
    apply_ac(model, mode="selective", offload_first=offload_first, compiled=True)
    apply_compile(model)
    model.to_empty(device=device)
    model.init_weights(seed=1, buffer_device=device)
    offloader = apply_offload(model, offload_first, device)
    tokens = torch.randint(0, args.vocab_size, (4, 2048), device=device, generator=None)
    loss_fn = torch.nn.functional.cross_entropy
    for _ in range(2):  # the first step compiles and allocates the pinned buffers
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if offloader is not None:
            offloader.bytes_offloaded = 0
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = loss_fn(logits.flatten(0, 1).float(), tokens.flatten())
        del logits
        loss.backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = {_canonical(n): p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, peak, offloader.bytes_offloaded if offloader else 0


def test_offload_same_gradients_less_memory():
    loss, grads, peak, _ = step(0)
    loss_off, grads_off, peak_off, moved = step(4)
    assert loss_off == loss
    for name, g in grads.items():
        torch.testing.assert_close(grads_off[name], g, rtol=0, atol=0, msg=name)
    # Half the blocks' saved tensors wait on the host at the peak (the end of forward): the peak falls
    # by most of what they moved (their copies out may still be finishing as forward ends).
    gib = 1 << 30
    assert moved > 4 * 0.2 * gib, f"moved only {moved / gib:.2f} GiB"
    assert peak - peak_off > 0.6 * moved, (
        f"peak {peak / gib:.2f} -> {peak_off / gib:.2f} GiB for {moved / gib:.2f} GiB moved"
    )
    print(f"peak {peak / gib:.2f} GiB -> {peak_off / gib:.2f} GiB, {moved / gib:.2f} GiB moved each way")


def test_the_trainer_offloads_on_cuda(tmp_path):
    args = [
        "--job.dump_folder", str(tmp_path), "--job.name", "off", "--training.steps", "3",
        "--model.flavor", "1B", "--data.dataset", "synthetic", "--training.precision", "bf16",
        "--training.seq_len", "1024", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.offload_first", "4",
    ]  # fmt: skip
    trainer = Trainer(config.load(None, args))
    try:
        losses = trainer.train()
    finally:
        trainer.close()
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    records = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    moved = [r["offload_gib"] for r in records if "offload_gib" in r]
    assert len(moved) == 3 and min(moved) > 0.1, moved  # 4 blocks of a 1B at 2 x 1024 tokens
