"""Context parallel's plumbing through the real trainer on gloo (CPU), with and without pipelining.

Run under torchrun: `torchrun --nproc_per_node=N tests/parallel/cp_probe.py OUT [--section.key value ...]`.

Ring attention needs CUDA (SDPA's GPU kernels), so here the model attends with the `math` backend, which
does not go through SDPA: each rank attends within its shard of the sequence, and the loss is not one
process's (the GPU tests compare that). What is checked is what the trainer does around attention under
context parallel, for two steps of the trainer's own forward/backward (`_forward_backward`, or
`_pipeline_run` through the schedule, then its forward-only validation pass): the probe's
tokens are their own positions, and
every attention call of every stage on every rank (each micro-batch, and the stages' shape inference)
must rotate with the rows of the whole RoPE table at its tokens' positions; the batch is sharded once
for the step, the tables are whole again after it, and the loss and gradient norm are finite and the
same on every rank. Each rank writes `OUT/rank<r>.json`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from titanrush import config, distributed
from titanrush.data.loader import Batch
from titanrush.models.llama.model import rope_cache
from titanrush.parallel.grad_clip import clip_grad_norm_
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer


def main(argv: list[str]) -> None:
    """The probe with `argv` = [OUT, --section.key value, ...] (also a case of `cases_probe.py`)."""
    out, overrides = Path(argv[0]), argv[1:]
    ranks = distributed.ranks_from_env()
    cfg = config.load(None, overrides)
    plan = build_plan(cfg, ranks.world_size, machine=False)  # (cp > 1 is refused without CUDA otherwise)
    plan = dataclasses.replace(plan, args=dataclasses.replace(plan.args, attn_backend="math"))
    trainer = Trainer(cfg, plan)
    seen: list[torch.Tensor] = []
    for part in trainer.model_parts:
        for block in part.layers.values():
            block.attention.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    seq, full = plan.seq_len, rope_cache(plan.args, plan.seq_len)

    def probe_batch(step: int) -> Batch:
        tokens = torch.arange(seq).repeat(plan.local_batch, 1)  # each token is its own position
        zeros = torch.zeros_like(tokens)
        return Batch(tokens, (tokens + step + 1) % plan.args.vocab_size, zeros, zeros.int())

    def check(batch: Batch) -> int:
        """The batch stayed sharded, and every attention call rotated with its tokens' rows of the table."""
        assert batch.input_ids.shape == (plan.local_batch, seq // plan.cp), batch.input_ids.shape
        positions = batch.input_ids[0]  # this rank's positions
        assert all(torch.equal(row, positions) for row in batch.input_ids), "micro-batches disagree"
        assert seen, "no attention ran on this rank"
        for table in seen:
            assert torch.equal(table, full[positions]), "a stage rotated with rows not at its positions"
        for part in trainer.model_parts:
            assert torch.equal(part.rope, full), "the RoPE table was not restored after the step"
        return len(seen)

    report: dict[str, object] = {"rank": ranks.rank, "calls": [], "losses": [], "grad_norms": []}
    for step in range(2):
        seen.clear()
        batch = probe_batch(step)
        trainer.optimizer.zero_grad(set_to_none=True)
        one = torch.ones(())  # (the loss divisor: the sum's plumbing is what this probe checks)
        if trainer.pipeline is not None:
            loss = trainer._pipeline_run(batch, one)
        else:
            loss = trainer._forward_backward(batch, one)
        report["calls"].append(check(batch))
        pp_mesh = trainer.mesh["pp"] if trainer.pipeline is not None else None
        norm = clip_grad_norm_(trainer.model.parameters(), 0.0, pp_mesh=pp_mesh)
        report["losses"].append(trainer._global_sum(loss).item())
        report["grad_norms"].append(norm.item())
    # Validation's forward-only pass through the schedule, sharded alike (torch's eval of ZBVZeroBubble
    # fails with or without context parallel: "can't steal_bwd_input if this stage doesn't have backward").
    if trainer.pipeline is not None and plan.pp_schedule != "ZBVZeroBubble":
        seen.clear()
        batch = probe_batch(2)
        report["val_loss"] = trainer._global_sum(
            trainer._pipeline_run(batch, torch.ones(()), evaluate=True)
        ).item()
        report["calls"].append(check(batch))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(report))
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
