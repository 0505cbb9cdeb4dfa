"""Imported by torchtitan through `--experimental.custom_import tt_parity` (side_by_side.py --parity).

Registers the train specs `llama3_parity` and `llama4_parity` (its `model.name`): torchtitan 0.2.2's own
llama3 and llama4 specs, through its `register_train_spec`, their model, parallelisms, loss, optimizer,
schedule and Hugging Face state-dict adapter unchanged, with an input source and three observers:

- the data: `training.dataset_path` names a `batch_dump` folder of titanrush's token batches, read in
  order, this data-parallel rank's part of each step (no tokenizer); the hash of each micro-batch the train
  step draws goes to tokens_rank<r>.jsonl;
- the optimizers as torchtitan builds them, with a step pre-hook that writes the hash of every weight
  (Hugging Face names, through the spec's own adapter) before the first update, i.e. of the weights that
  `checkpoint.initial_load_path` loaded (weights.json, rank 0);
- on Llama 4, a forward hook on the model that writes each MoE layer's tokens per expert of each step
  (experts_rank<r>.jsonl: this rank's, before torchtitan's bias update resets them);
- the metrics processor, with a copy of every logged value at full precision (metrics.jsonl, rank 0).

The files go to the folder TT_PARITY_OUT names. The shapes of tt_flavors are added too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import tt_flavors  # noqa: F401 (the 1B, 3B and Llama 4 benchmark shapes)
from batch_dump import DumpReader, HashLog, batch_hash, weight_hashes
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.metrics import BaseLogger, LoggerContainer, build_metrics_processor
from torchtitan.models import llama3, llama4
from torchtitan.protocols.train_spec import register_train_spec

OUT = Path(os.environ.get("TT_PARITY_OUT", "parity"))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class DumpLoader(BaseDataLoader):
    """This data-parallel rank's batches of a dump, step after step; its state is the step."""

    def __init__(self, folder: str, *, dp_rank: int, dp_degree: int, local_batch: int, seq_len: int) -> None:
        self.dump = DumpReader(folder)
        found = (self.dump.ranks, self.dump.local_batch, self.dump.seq_len)
        if found != (dp_degree, local_batch, seq_len):
            raise ValueError(
                f"{folder}: (ranks, batch, seq_len) {found}, this run {(dp_degree, local_batch, seq_len)}"
            )
        self.dp_rank, self.step = dp_rank, 0
        self.log = HashLog(OUT / f"tokens_rank{_rank()}.jsonl")

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while self.step < self.dump.steps:
            self.step += 1
            inputs, labels = self.dump.batch(self.step, self.dp_rank)
            self.log.write({"step": self.step, "dp_rank": self.dp_rank, "hash": batch_hash(inputs, labels)})
            yield {"input": inputs}, labels

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def build_dump_loader(
    dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **_: Any
) -> DumpLoader:
    t = job_config.training
    return DumpLoader(
        t.dataset_path,
        dp_rank=dp_rank,
        dp_degree=dp_world_size,
        local_batch=t.local_batch_size,
        seq_len=t.seq_len,
    )


def write_weight_hashes(model_parts: list[torch.nn.Module], adapter_cls: type) -> None:
    """Rank 0 writes weights.json: {Hugging Face name: hash} of the model's full weights (every rank
    gathers its shards: a collective)."""
    full: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for name, value in get_model_state_dict(part).items():
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            if _rank() == 0:
                full[name] = tensor.detach().cpu()
    if _rank() == 0:
        hf = adapter_cls(model_parts[0].model_args, None).to_hf(full)
        HashLog(OUT / "weights.json").write(weight_hashes(hf))


def watch_experts(model: torch.nn.Module) -> None:
    """On a model with MoE layers: after each training forward, this rank's tokens per expert of every
    MoE layer so far this step (torchtitan's bias update resets them before the optimizer step)."""
    blocks = [b for b in model.layers.values() if getattr(b, "moe_enabled", False)]
    if not blocks:
        return
    log, step = HashLog(OUT / f"experts_rank{_rank()}.jsonl"), [0]

    def record(module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        step[0] += 1
        counts = torch.stack([b.moe.tokens_per_expert.float() for b in blocks]).tolist()
        log.write({"step": step[0], "tokens": [[round(c) for c in layer] for layer in counts]})

    model.register_forward_hook(record)


def observed_optimizers(build: Callable[..., Any], adapter_cls: type) -> Callable[..., Any]:
    """torchtitan's optimizer builder, plus the weights' hashes before the first step and the experts'
    load (the two observers of the module docstring)."""

    def build_observed(model_parts: list[torch.nn.Module], *args: Any, **kwargs: Any) -> Any:
        optimizers = build(model_parts, *args, **kwargs)
        pending = [True]

        def before_step(*_: Any) -> None:
            if pending:
                pending.clear()
                write_weight_hashes(model_parts, adapter_cls)

        optimizers.register_step_pre_hook(before_step)  # (after torchtitan's own: the bias update)
        for part in model_parts:
            watch_experts(part)
        return optimizers

    return build_observed


class JsonlLogger(BaseLogger):
    """Every logged metric of a step as one JSON line."""

    def __init__(self, path: Path) -> None:
        self.out = HashLog(path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        plain = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        self.out.write({"step": step, **plain})


def build_metrics(job_config: Any, parallel_dims: Any, model_args: Any = None, **kwargs: Any) -> Any:
    processor = build_metrics_processor(job_config, parallel_dims, model_args, **kwargs)
    if _rank() == 0:
        both = LoggerContainer()
        both.add_logger(processor.logger)
        both.add_logger(JsonlLogger(OUT / "metrics.jsonl"))
        processor.logger = both
    return processor


for _name, _module in (("llama3", llama3), ("llama4", llama4)):
    _spec = _module.get_train_spec()
    register_train_spec(
        f"{_name}_parity",
        dataclasses.replace(
            _spec,
            build_dataloader_fn=build_dump_loader,
            build_tokenizer_fn=None,
            build_validator_fn=None,
            build_optimizers_fn=observed_optimizers(_spec.build_optimizers_fn, _spec.state_dict_adapter),
            build_metrics_processor_fn=build_metrics,
        ),
    )
