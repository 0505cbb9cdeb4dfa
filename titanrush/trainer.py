"""The trainer: builds everything from the config in one documented order, then runs the loop.

Build order (each step only sees the values it needs):
 0. the run plan (`titanrush.plan.build_plan`): every check that needs no allocation, and every
    decision of the run, so bad input fails before anything is built or written
 1. the device, the process group and the DeviceMesh; the run folder checked (not yet written)
 2. the tokenizer, the model on the meta device -> (pipeline stages ->) parallelize_llama (float8 -> TP ->
    CP -> AC -> compile -> FSDP/DDP) -> to_empty on the device -> init_weights(seed), identical
    whatever the mesh
 3. optimizer and LR schedule; data loaders; checkpoint manager (resumes if a checkpoint exists)
 4. the run folder written (config.toml), metrics (console, metrics.jsonl, TensorBoard), the profiler
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanrush import config as cfgmod
from titanrush import distributed, run_dir
from titanrush.checkpoint import CheckpointManager
from titanrush.config import JobConfig
from titanrush.data import build_dataloader, build_tokenizer
from titanrush.metrics import (
    MemoryMonitor,
    MetricsLogger,
    Throughput,
    flops_per_token,
    matmul_params,
    peak_tflops,
)
from titanrush.models.llama import Llama
from titanrush.models.llama.loss import cross_entropy
from titanrush.models.llama.parallelize import parallelize_llama
from titanrush.models.llama.pipeline import PipelinedLlama, pipeline_llama
from titanrush.models.llama4 import Llama4, Llama4Args
from titanrush.models.llama4.balance import ExpertBalance
from titanrush.optim import build_lr_scheduler, build_optimizer
from titanrush.parallel.activation_offload import ActivationOffloader, bind_near_gpu
from titanrush.parallel.context_parallel import context_parallel_step, set_rotate_method
from titanrush.parallel.float8 import precompute_float8_scales
from titanrush.parallel.grad_clip import clip_grad_norm_
from titanrush.parallel.tensor_parallel import loss_parallel_context
from titanrush.plan import RunPlan, build_plan, describe_mesh
from titanrush.profiling import Profiler

logger = logging.getLogger("titanrush")


class Trainer:
    """Owns the model, optimizer, data and metrics of one run."""

    def __init__(self, cfg: JobConfig, plan: RunPlan | None = None) -> None:
        """`plan`: the run's plan where the caller has built it (else built here from `cfg`)."""
        self.cfg = cfg
        marks = [("start", time.perf_counter())]  # set-up stages, logged with their durations at the end
        ranks = distributed.ranks_from_env()
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.plan = plan = plan or build_plan(cfg, self.world_size)
        # 1. Device, process group, mesh, run folder.
        if torch.cuda.is_available():
            self.device = torch.device("cuda", ranks.local_rank)
            distributed.set_allocator_env(os.environ, expandable=cfg.training.expandable_segments)
            torch.cuda.set_device(self.device)
            if plan.ac_offload_first > 0:  # pinned host memory next to this GPU
                cpus = bind_near_gpu(self.device)
                if cpus is not None:
                    logger.info(f"activation offload: bound to the GPU's {len(cpus)} NUMA-local CPUs")
        else:
            self.device = torch.device("cpu")
        distributed.init(self.device, nccl_max_ctas=cfg.parallelism.nccl_max_ctas)
        marks.append(("config and process group", time.perf_counter()))
        self.mesh = plan.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        marks.append(("mesh", time.perf_counter()))
        self.run_dir = Path(cfg.job.dump_folder) / cfg.job.name
        run_dir.check(self.run_dir, overwrite=cfg.job.overwrite, rank=self.rank)
        if plan.cp > 1:
            set_rotate_method(plan.cp_rotate)
        _set_determinism(cfg.training)
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None and plan.dp > 1 else 0

        # 2. Model: meta -> parallelize -> materialize -> init.
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        with torch.device("meta"):
            model = (Llama4 if isinstance(plan.args, Llama4Args) else Llama)(plan.args)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = flops_per_token(plan.args, matmul_params(model), plan.seq_len)
        marks.append(("tokenizer and model on meta", time.perf_counter()))
        self.offloaders: list[ActivationOffloader] = []

        def parallelize(module: torch.nn.Module) -> torch.nn.Module:
            offloader = parallelize_llama(module, plan, self.mesh, device=self.device)
            if offloader is not None:
                self.offloaders.append(offloader)
            return module

        self.pipeline: PipelinedLlama | None = None
        if plan.pp > 1:
            ids = plan.stage_ids(self.mesh["pp"].get_local_rank())
            self.pipeline = pipeline_llama(
                model,
                stage_layers={s: plan.stage_layers(s) for s in ids},
                n_stages=plan.n_stages,
                schedule=plan.pp_schedule,
                microbatches=plan.microbatches,
                pp_mesh=self.mesh["pp"],
                device=self.device,
                loss_fn=self._pipeline_loss,
                parallelize=parallelize,
            )
            self.model_parts = self.pipeline.parts
            model = self.pipeline.view
            logger.info(f"pipeline: {plan.pp_schedule}, layers per stage {list(plan.layers_per_stage)}")
        else:
            model = parallelize(model)
            self.model_parts = [model]
        marks.append(("parallelize", time.perf_counter()))
        # FSDP's CPU offload keeps the sharded parameters in host memory (buffers stay on the device).
        param_device = torch.device("cpu") if plan.cpu_offload else self.device
        for part in self.model_parts:
            part.to_empty(device=param_device)
            part.init_weights(seed=cfg.training.seed, buffer_device=self.device)
            part.train()
        marks.append(("weights materialized and initialized", time.perf_counter()))
        self.model = model
        # Llama 4: the experts' load, and the routing bias moved by it, once per step (summed over dp x cp).
        group = self.mesh["dp_cp"].get_group() if self.mesh is not None and plan.dp * plan.cp > 1 else None
        tokens = plan.local_batch * plan.seq_len * plan.accum * plan.dp
        self.balance = ExpertBalance(self.model_parts, rate=plan.moe_bias_rate, group=group, tokens=tokens)
        self.moe_stats: dict[str, Any] = {}
        # The loss (log-softmax over the vocabulary in fp32) fuses well; under loss parallel it works on
        # DTensors, which stay eager.
        self.loss_fn = torch.compile(cross_entropy) if plan.compiled_loss else cross_entropy

        # 3. Optimizer, schedule, data, checkpoints.
        o, s = cfg.optimizer, cfg.lr_scheduler
        self.optimizer = build_optimizer(
            model.parameters(),
            name=o.name,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            implementation=o.implementation,
        )
        self.scheduler = build_lr_scheduler(
            self.optimizer,
            warmup_steps=s.warmup_steps,
            total_steps=cfg.training.steps,
            decay=s.decay,
            decay_ratio=s.decay_ratio,
            min_lr_factor=s.min_lr_factor,
        )
        marks.append(("optimizer", time.perf_counter()))
        self.loader_args = dict(
            tokenizer=self.tokenizer,
            seq_len=plan.seq_len,
            local_batch_size=plan.local_batch,
            dp_rank=dp_rank,
            dp_degree=plan.dp,
            seed=cfg.training.seed,
            vocab_size=plan.args.vocab_size,
        )
        self.train_loader = build_dataloader(cfg.data, split="train", **self.loader_args)
        self._val_loader: Any = None
        marks.append(("data", time.perf_counter()))
        ck = cfg.checkpoint
        self.checkpointer = CheckpointManager(
            self.run_dir / ck.folder,
            enable=ck.enable,
            interval=ck.interval,
            keep_latest_k=ck.keep_latest_k,
            async_mode=ck.async_mode,
            model_parts=[model],  # the pipeline's view holds every stage of this rank under full names
            optimizers=[self.optimizer],
            lr_scheduler=self.scheduler,
            dataloader=self.train_loader,
            # (the RoPE table's length is this run's, not the model's: a model rebuilt from the checkpoint
            # gets the full table)
            info={
                "flavor": cfg.model.flavor,
                "model_args": dataclasses.asdict(dataclasses.replace(plan.args, rope_positions=0)),
            },
            rank=self.rank,
        )
        self.step = self.checkpointer.resume(load_path=ck.load_path, model_only=ck.load_model_only)

        # 4. The run is accepted: its folder, metrics and profiler.
        run_dir.create(self.run_dir, cfgmod.to_toml(cfg), rank=self.rank)
        self.metrics = MetricsLogger(
            self.run_dir,
            enabled=self.rank == 0 or cfg.metrics.all_ranks,
            tensorboard=cfg.metrics.tensorboard,
            rank=self.rank,
        )
        self.memory = MemoryMonitor(self.device)
        pr = cfg.profiling
        self.profiler = Profiler(
            self.run_dir,
            enable=pr.enable,
            freq=pr.freq,
            active=pr.active_steps,
            memory_snapshot=pr.memory_snapshot,
            rank=self.rank,
            all_ranks=pr.all_ranks,
            start_step=self.step,
        )
        self._log_checkpoint_records()  # the load time of a resume
        self.peak = self._peak_tflops()
        marks.append(("checkpoint, metrics, profiler", time.perf_counter()))
        self._log_header()
        stages = ", ".join(f"{name} {t1 - t0:.1f}" for (_, t0), (name, t1) in itertools.pairwise(marks))
        logger.info(f"set-up {marks[-1][1] - marks[0][1]:.1f} s: {stages}")

    # ------------------------------------------------------------------------------------------
    def _peak_tflops(self) -> float | None:
        if self.cfg.metrics.peak_tflops > 0:
            return self.cfg.metrics.peak_tflops
        if self.device.type != "cuda":
            logger.warning("MFU is not reported on CPU; set metrics.peak_tflops to report one")
            return None
        name = torch.cuda.get_device_name(self.device)
        precision = "bf16" if self.cfg.float8.enable else self.cfg.training.precision
        peak = peak_tflops(name, precision)
        if peak is None:
            logger.warning(
                f"GPU {name!r} is not in titanrush's peak table: MFU is not reported; set "
                f"metrics.peak_tflops to this GPU's dense {precision} TFLOP/s"
            )
        elif self.cfg.float8.enable:
            logger.info(f"float8: MFU is against the bf16 peak ({peak:.0f} TFLOP/s); TFLOP/s is exact")
        return peak

    def _log_header(self) -> None:
        p, a = self.plan, self.plan.args
        logger.info(
            f"titanrush: {self.cfg.model.flavor} ({self.n_params / 1e6:,.1f}M params, {a.n_layers} layers, "
            f"dim {a.dim}) on {self.world_size} x {self.device.type}; mesh {describe_mesh(p)}"
        )
        logger.info(
            f"batch: local {p.local_batch} x seq {p.seq_len}, accumulation {p.accum}, "
            f"global {p.local_batch * p.dp * p.accum}; {self.flops_per_token / 1e9:.3f} GFLOP/token; "
            f"run folder {self.run_dir}"
        )

    # ------------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast where no FSDP mixed-precision policy does the casting."""
        if self.plan.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_parallel(self) -> contextlib.AbstractContextManager:
        """Under tensor parallel with loss parallel: the loss on the vocabulary-sharded logits."""
        return loss_parallel_context(self.plan.tp > 1 and self.plan.loss_parallel)

    def _document_inputs(self, batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(position_ids, document_ids) for the model: with flex attention, block-causal attention within
        each document and positions restarting at each document start; else plain causal attention."""
        if self.plan.args.attn_backend == "flex":
            return batch.position_ids, batch.document_ids
        return None, None

    def _forward_backward(self, batch: Any) -> torch.Tensor:
        """Loss of one micro-batch (divided by the accumulation steps), with backward done."""
        ctx = self._autocast()
        chunked = self.plan.args.loss_chunk_size > 0
        inputs, labels = batch.input_ids, batch.labels
        positions, docs = self._document_inputs(batch)
        cp_ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.plan.cp > 1:
            # Positions are sharded with the tokens, so each shard's RoPE uses its tokens' true positions.
            positions = torch.arange(inputs.shape[1], device=self.device).expand_as(inputs).contiguous()
            cp_ctx = context_parallel_step(self.mesh["cp"], [inputs, labels, positions])
        with cp_ctx, self._loss_parallel():
            with ctx:  # autocast covers the forward and the loss; backward runs outside it, which frees
                # autocast's cache of bf16 weight copies as soon as backward is done with each one
                if chunked:
                    loss = self.model(inputs, position_ids=positions, document_ids=docs, labels=labels)
                else:
                    loss = self.loss_fn(self.model(inputs, position_ids=positions, document_ids=docs), labels)
                loss = loss / self.plan.accum
            loss.backward()
        # Under loss parallel the loss is a replicated DTensor: its local value is the loss.
        return _local(loss.detach())

    def _pipeline_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss per pipeline micro-batch, scaled so that a step's losses sum to the mean."""
        loss = self.loss_fn(pred, labels)
        return loss / (self.pipeline.microbatches * self.plan.accum)

    def _pipeline_forward_backward(self, batch: Any) -> torch.Tensor:
        """One local batch through the pipeline schedule; the loss is nonzero on the last stage only."""
        p = self.pipeline
        losses: list[torch.Tensor] | None = [] if p.has_last else None
        target = batch.labels if p.has_last else None
        # bf16 without FSDP is autocast: the schedule runs each stage's forward inside this context.
        with self._autocast(), self._loss_parallel():
            if p.has_first:
                p.schedule.step(batch.input_ids, target=target, losses=losses)
            else:
                p.schedule.step(target=target, losses=losses)
        if not losses:
            return torch.zeros((), device=self.device)
        return _local(torch.stack([x.detach().float() for x in losses]).sum())

    def _pipeline_eval(self, batch: Any) -> torch.Tensor:
        """Forward-only pass of one batch through the pipeline: the batch's mean loss on the last stage
        (times the accumulation steps the loss function divides by), zero on the others."""
        p = self.pipeline
        losses: list[torch.Tensor] | None = [] if p.has_last else None
        target = batch.labels if p.has_last else None
        inputs = (batch.input_ids,) if p.has_first else ()
        with torch.no_grad(), self._autocast(), self._loss_parallel():
            p.schedule.eval(*inputs, target=target, losses=losses)
        if not losses:
            return torch.zeros((), device=self.device)
        return _local(torch.stack([x.detach().float() for x in losses]).sum() * self.plan.accum)

    def train_step(self, data_iter: Iterator[Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum` micro-batches; returns (loss, grad norm, data wait seconds)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        data_wait = 0.0
        step_fn = self._pipeline_forward_backward if self.pipeline is not None else self._forward_backward
        for _ in range(self.plan.accum):
            t0 = time.perf_counter()
            batch = next(data_iter).to(self.device, non_blocking=True)
            data_wait += time.perf_counter() - t0
            total += step_fn(batch)
        pp_mesh = self.mesh["pp"] if self.pipeline is not None else None
        grad_norm = clip_grad_norm_(self.model.parameters(), self.plan.max_norm, pp_mesh=pp_mesh)
        # This step's rate (torchao's low-bit AdamW keeps it as a tensor).
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        self.checkpointer.wait_for_staging()  # an async_pinned save may still be copying the weights
        self.moe_stats = self.balance.step()
        self.optimizer.step()
        if self.plan.float8_all_gather:  # FSDP's float8 all-gather: every weight's scale, once per step
            precompute_float8_scales(self.model)
        self.scheduler.step()
        return total, grad_norm, data_wait

    def _global_mean(self, value: torch.Tensor) -> float:
        """Average over the data-parallel (and context-parallel) ranks; the same on every rank.

        With pipelining only the last stage holds the loss: summing over the pipeline ranks first gives
        every stage the true value.
        """
        if self.mesh is None:
            return value.item()
        value = value.detach().float().clone()
        if self.plan.pp > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh["pp"].get_group())
        if self.plan.dp * self.plan.cp == 1:
            return value.item()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh["dp_cp"].get_group())
        return value.item() / (self.plan.dp * self.plan.cp)

    def train(self, stop_at: int | None = None) -> list[float]:
        """Run the loop to training.steps (or to step `stop_at`, as if the job were cut off there);
        return the losses of the logged steps."""
        t = self.cfg.training
        last = t.steps if stop_at is None else min(stop_at, t.steps)
        if t.gc_freq > 0:
            gc.disable()
            gc.collect()
        data_iter = iter(self.train_loader)
        throughput = Throughput(self.flops_per_token, self.peak)
        logged: list[float] = []
        while self.step < last:
            self.step += 1
            if t.gc_freq > 0 and self.step % t.gc_freq == 0:
                gc.collect(1)
            for offloader in self.offloaders:  # the traffic of the step about to run
                offloader.bytes_offloaded = 0
            loss, grad_norm, data_wait = self.train_step(data_iter)
            self.profiler.step()
            throughput.add(self.plan.tokens_per_gpu_step, data_wait)
            if self._should_log(self.step):
                loss_value = self._global_mean(loss)
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at step {self.step}")
                logged.append(loss_value)
                mem = self.memory.read_and_reset()
                record = {
                    "loss": loss_value,
                    "grad_norm": grad_norm.item(),
                    "lr": self.lr,
                    **throughput.read(),
                    "mem_active_gib": mem.active_gib,
                    "mem_reserved_gib": mem.reserved_gib,
                    "mem_active_pct": mem.active_pct,
                    "mem_reserved_pct": mem.reserved_pct,
                    **self.moe_stats,
                }
                if self.offloaders:  # activation offload: GiB this rank moved to the host (and back)
                    record["offload_gib"] = sum(o.bytes_offloaded for o in self.offloaders) / 2**30
                self.metrics.log(self.step, record)
                throughput.reset()
            validate = bool(self.cfg.validation.freq) and self.step % self.cfg.validation.freq == 0
            if validate:
                self.validate()
            ck = self.cfg.checkpoint
            self.checkpointer.maybe_save(
                self.step,
                last=self.step == t.steps,
                model_only=ck.last_save_model_only,
                dtype=getattr(torch, ck.export_dtype),
            )
            self._log_checkpoint_records()
        if t.gc_freq > 0:
            gc.enable()
        return logged

    def _should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps

    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over validation.steps batches of the held-out split (same batches every time)."""
        self.model.eval()
        if self._val_loader is None:  # built once: a validation pass replays the same batches
            self._val_loader = build_dataloader(self.cfg.data, split="validation", **self.loader_args)
        total = torch.zeros((), device=self.device)
        n = 0
        for batch in itertools.islice(self._val_loader, self.cfg.validation.steps):
            batch = batch.to(self.device)
            n += 1
            if self.pipeline is not None:
                total += self._pipeline_eval(batch)
                continue
            with self._autocast(), self._loss_parallel():
                positions, docs = self._document_inputs(batch)
                logits = self.model(batch.input_ids, position_ids=positions, document_ids=docs)
                loss = self.loss_fn(logits, batch.labels).detach()
                total += _local(loss)
        self.model.train()
        loss = self._global_mean(total / max(n, 1))
        self.metrics.log(self.step, {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))})
        return loss

    def _log_checkpoint_records(self) -> None:
        """Log the timings of the saves that completed (and of a resume): own rows, no `loss`."""
        for step, values in self.checkpointer.records:
            self.metrics.log(step, values)
        self.checkpointer.records.clear()

    def close(self) -> None:
        self.profiler.close()
        self.checkpointer.close()  # waits for a save in flight
        self._log_checkpoint_records()
        self.metrics.close()
        distributed.destroy()


def _set_determinism(t: cfgmod.Training) -> None:
    torch.manual_seed(t.seed)
    if t.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    # fp32 runs are measured against the fp32 peak, so keep TF32 tensor cores off for them.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: under loss parallel it is a replicated DTensor whose local value is it."""
    return t.to_local() if isinstance(t, DTensor) else t
