"""The trainer: builds everything from the config in one documented order, then runs the loop.

Build order (each step only sees the values it needs):
 0. the run plan (`titanrush.run.plan.build_plan`, built once by the caller: `titanrush.train`, with the
    auto levers chosen and the memory checked: `titanrush.run.memory_check`): every check that needs no
    allocation, and every decision of the run, so bad input fails before anything is built or written
 1. the device, the process group and the DeviceMesh; the run folder checked (not yet written)
 2. the tokenizer, the model on the meta device -> (pipeline stages ->) parallelize_llama (float8 -> TP ->
    CP -> AC -> compile -> FSDP/DDP) -> to_empty on the device -> init_weights(seed), identical
    whatever the mesh
 3. optimizer and LR schedule; data loaders; checkpoint manager (resumes if a checkpoint exists)
 4. the run folder written (config.toml) as this run's attempt, metrics (console, metrics.jsonl,
    TensorBoard), the profiler

The loop's safeguards live in small modules: `titanrush.run.nonfinite` (a non-finite step stops the run or
is skipped, and is never saved), `titanrush.run.signals` (SIGTERM/SIGINT stop at a step boundary all ranks
agree on, after a checkpoint), `titanrush.run.run_dir` (the folder's lock and attempts),
`titanrush.run.watchdog` (a step that does not finish in time ends the job, with every rank's stacks).
After the loop, `summarize` prints the run's summary and its next commands (`titanrush.run.summary`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from titanrush import config as cfgmod
from titanrush import distributed
from titanrush.checkpoint.folder import scan
from titanrush.checkpoint.manager import CheckpointManager
from titanrush.clip_adamw import ClipAdamW
from titanrush.config import JobConfig
from titanrush.data import build_dataloader, build_tokenizer, repeats
from titanrush.launch_env import restart_from_env
from titanrush.metrics import (
    MemoryMonitor,
    MetricsLogger,
    Throughput,
    flops_per_token,
    log_header,
    matmul_params,
    resolve_peak,
)
from titanrush.models.llama import Llama
from titanrush.models.llama.loss import (
    cross_entropy_sum,
    loss_divisor,
    valid_tokens,
    vocab_parallel_cross_entropy_sum,
)
from titanrush.models.llama.parallelize import parallelize_llama
from titanrush.models.llama.pipeline import PipelinedLlama, pipeline_llama
from titanrush.models.llama4 import Llama4, Llama4Args
from titanrush.models.llama4.balance import ExpertBalance
from titanrush.optim import build_lr_scheduler, build_optimizer
from titanrush.parallel.activation_offload import ActivationOffloader, bind_near_gpu
from titanrush.parallel.context_parallel import cp_step_context, set_rotate_method
from titanrush.parallel.float8 import precompute_float8_scales
from titanrush.parallel.grad_clip import clip_grad_norm_
from titanrush.profiling import Profiler
from titanrush.run import run_dir, validate
from titanrush.run.nonfinite import NonFiniteError, NonFiniteGuard, moe_suspects, poison
from titanrush.run.plan import RunPlan, describe_mesh
from titanrush.run.preflight import checkpoint_info
from titanrush.run.signals import StopSignals, stop_message
from titanrush.run.summary import RunSummary, summary_lines, with_setting, write_summary
from titanrush.run.wandb_sink import start_wandb
from titanrush.run.watchdog import StepWatchdog

logger = logging.getLogger("titanrush")


class Trainer:
    """Owns the model, optimizer, data and metrics of one run."""

    def __init__(self, cfg: JobConfig, plan: RunPlan) -> None:
        """`plan`: the run's plan, built once by the caller before the process group exists (a bad config
        fails there): `build_plan(cfg, world_size)`, or `memory_check.plan_run`'s, whose `cfg` has its
        auto levers resolved (this config is the run folder's config.toml: none may be left)."""
        assert not validate.auto_levers(cfg), validate.auto_levers(cfg)
        self.cfg = cfg
        marks = [("start", time.perf_counter())]  # set-up stages, logged with their durations at the end
        ranks = distributed.ranks_from_env()
        self.rank, self.world_size = ranks.rank, ranks.world_size
        assert plan.world_size == self.world_size, (plan.world_size, self.world_size)
        self.plan = plan
        # 1. Device, process group, mesh, run folder.
        self.device = distributed.init_device(ranks.local_rank, expandable=cfg.training.expandable_segments)
        if plan.ac.offload_first > 0 and self.device.type == "cuda":  # pinned host memory next to this GPU
            bind_near_gpu(self.device)
        distributed.init(
            self.device, nccl_max_ctas=cfg.parallelism.nccl_max_ctas, timeout_s=cfg.job.collective_timeout
        )
        marks.append(("process group", time.perf_counter()))
        timeout = cfg.job.collective_timeout
        self.mesh = plan.dims.build_mesh(self.device.type, timeout) if self.world_size > 1 else None
        marks.append(("mesh", time.perf_counter()))
        self.run_dir = Path(cfg.job.dump_folder) / cfg.job.name
        self.lock = run_dir.check(self.run_dir, overwrite=cfg.job.overwrite, rank=self.rank)
        try:  # a run refused from here on lets the folder go, and removes the lock file it made
            self._build(cfg, plan, marks)
        except BaseException:
            self.lock.release(refused=True)
            raise

    def _build(self, cfg: JobConfig, plan: RunPlan, marks: list[tuple[str, float]]) -> None:
        """Steps 2 to 4 of the build order (the module docstring), once the run folder is locked."""
        if plan.cp > 1:
            set_rotate_method(plan.cp_plan.rotate)
        distributed.set_determinism(cfg.training.seed, deterministic=cfg.training.deterministic)
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None and plan.dp > 1 else 0

        # 2. Model: meta -> parallelize -> materialize -> init.
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        with torch.device("meta"):
            model = (Llama4 if isinstance(plan.args, Llama4Args) else Llama)(plan.args)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = flops_per_token(plan.args, matmul_params(model), plan.seq_len)
        marks.append(("model on meta", time.perf_counter()))
        self.offloaders: list[ActivationOffloader] = []

        def parallelize(module: torch.nn.Module) -> torch.nn.Module:
            offloader = parallelize_llama(module, self.mesh, plan.parallelize_plan, device=self.device)
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
        param_device = torch.device("cpu") if plan.fsdp_plan.cpu_offload else self.device
        for part in self.model_parts:
            part.to_empty(device=param_device)
            part.init_weights(seed=cfg.training.seed, buffer_device=self.device)
            part.train()
        marks.append(("weights", time.perf_counter()))
        self.model = model
        # Llama 4: the experts' load, and the routing bias moved by it, once per step (summed over dp x cp,
        # and x tp where each tp rank routes its own sequence shard).
        view = "dp_cp_tp" if plan.moe_tp and plan.tp_plan.sequence_parallel else "dp_cp"
        group = self.mesh[view].get_group() if self.mesh is not None and self.mesh[view].size() > 1 else None
        tokens = plan.local_batch * plan.seq_len * plan.accum * plan.dp
        self.balance = ExpertBalance(self.model_parts, rate=plan.moe_bias_rate, group=group, tokens=tokens)
        # The loss (log-softmax over the vocabulary in fp32) fuses well; under loss parallel the logits are
        # DTensors sharded over the vocabulary, reduced over the shards by their own function. It is a sum:
        # the step divides it by its global count of valid tokens.
        self.loss_fn = (
            vocab_parallel_cross_entropy_sum
            if plan.vocab_parallel_loss
            else torch.compile(cross_entropy_sum)
            if plan.compiled_loss
            else cross_entropy_sum
        )
        self._norm = torch.ones((), device=self.device)  # the pipeline loss's divisor of the current step
        suspects = moe_suspects(cfg.moe) if isinstance(plan.args, Llama4Args) else ()
        self.guard = NonFiniteGuard(cfg.training.on_nonfinite, cfg.training.max_skips, suspects)
        self.signals = StopSignals()  # (every rank: it may create a process group)
        self.stopped_by: int | None = None
        self.stop_reason = ""

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
        self._val_loader: Any = None  # (a run that validates checks its split now, not at the first pass)
        if cfg.validation.freq:
            self._val_loader = build_dataloader(cfg.data, split="validation", **self.loader_args)
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
            info=checkpoint_info(cfg, plan),
            rank=self.rank,
            allow_data_change=cfg.data.allow_changed,
        )
        self.step = self.checkpointer.resume(
            load_path=ck.load_path, model_only=ck.load_model_only, steps=cfg.training.steps
        )
        self.start_step = self.step  # (this attempt trains the steps after it)
        said = repeats(self.train_loader, cfg.data, cfg.training.steps, plan.accum, self.step)
        if self.rank == 0 and said:
            logger.warning(said)
        self.last_loss: tuple[int, float] | None = None  # (step, loss) of the last logged training row
        self.validations: list[tuple[int, float]] = []  # (step, validation loss) of this attempt

        # 4. The run is accepted: its folder, metrics and profiler.
        self.attempt = run_dir.create(
            self.run_dir, cfgmod.to_toml(cfg), rank=self.rank, lock=self.lock, resumed_step=self.step
        )
        self.metrics = MetricsLogger(
            self.run_dir,
            enabled=self.rank == 0 or cfg.metrics.all_ranks,
            tensorboard=cfg.metrics.tensorboard,
            rank=self.rank,
            attempt=self.attempt,
        )
        self.wandb_where: str | None = None  # where the W&B run went (the summary names it)
        if cfg.metrics.wandb and self.rank == 0:  # (rank 0 alone, whatever metrics.all_ranks says)
            sink = start_wandb(
                self.run_dir,
                project=cfg.metrics.wandb_project,
                name=cfg.metrics.wandb_name,
                job=cfg.job.name,
                attempt=self.attempt,
                config=dataclasses.asdict(cfg),
            )
            self.metrics.sinks.append(sink)
            self.wandb_where = sink.where
        if (restart := restart_from_env()) is not None:  # the launcher restarted the job after a failure
            self.metrics.log(self.step, {"restart": restart.count, "cause": restart.cause})
        self.memory = MemoryMonitor(self.device)
        pr = cfg.profiling
        self.profiler = Profiler(
            self.run_dir,
            enable=pr.enable,
            freq=pr.freq,
            active=pr.active_steps,
            rank=self.rank,
            memory_snapshot=pr.memory_snapshot,
            all_ranks=pr.all_ranks,
            start_step=self.step,
        )
        self._log_checkpoint_records()  # the load time of a resume
        self.peak = resolve_peak(
            self.device,
            configured=cfg.metrics.peak_tflops,
            precision=plan.precision,
            float8=plan.float8.enable,
        )
        marks.append(("checkpoint, metrics", time.perf_counter()))
        log_header(
            cfg.model.flavor,
            plan,
            describe_mesh(plan),
            self.n_params,
            self.flops_per_token,
            self.run_dir,
            peak=self.peak,
        )
        # The stages that took a tenth of a second or more (the line fits a terminal).
        spans = [(name, t1 - t0) for (_, t0), (name, t1) in itertools.pairwise(marks)]
        stages = ", ".join(f"{name} {s:.1f}" for name, s in spans if s >= 0.05)
        self.setup_s = marks[-1][1] - marks[0][1]
        logger.info(f"set-up {self.setup_s:.1f} s: {stages or 'each stage under 0.1 s'}")

    # ------------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast where no FSDP mixed-precision policy does the casting."""
        bf16 = self.plan.autocast
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def _step_inputs(self, batch: Any) -> tuple[Any, ...]:
        """(inputs, labels, position_ids, document_ids, context) of one micro-batch. With flex attention:
        block-causal attention within each document, positions restarting at each document start; else
        causal (None, None). Under context parallel, the context shards the sequence in place over the cp
        ranks with every model part's RoPE table (`_cp_step`), so that each shard's tokens keep their true
        positions."""
        inputs, labels, flex = batch.input_ids, batch.labels, self.plan.args.attn_backend == "flex"
        positions, docs = (batch.position_ids, batch.document_ids) if flex else (None, None)
        return inputs, labels, positions, docs, self._cp_step(inputs, labels)

    def _loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: Any, docs: Any, norm: torch.Tensor
    ) -> torch.Tensor:
        """This rank's summed token loss divided by `norm` (training and validation alike). The chunked
        loss gives the mean over this rank's valid tokens: times their count, it is the sum."""
        if self.plan.args.loss_chunk_size > 0:
            mean = self.model(inputs, position_ids=positions, document_ids=docs, labels=labels)
            return mean * valid_tokens(labels) / norm
        return self.loss_fn(self.model(inputs, position_ids=positions, document_ids=docs), labels) / norm

    def _forward_backward(self, batch: Any, norm: torch.Tensor) -> torch.Tensor:
        """This rank's loss of one micro-batch (its sum over `norm`), with backward done."""
        inputs, labels, positions, docs, cp_ctx = self._step_inputs(batch)
        with cp_ctx:
            with self._autocast():  # autocast covers the forward and the loss; backward runs outside it,
                # which frees autocast's cache of bf16 weight copies as soon as backward is done with each
                loss = poison(self._loss(inputs, labels, positions, docs, norm))
            loss.backward()
        return loss.detach()

    def _cp_step(self, *batch: torch.Tensor) -> contextlib.AbstractContextManager:
        """Under context parallel: the batch's tensors and every model part's RoPE table sharded over cp
        (in one layout: each token keeps its true position), SDPA as ring attention, for one step."""
        cp_mesh = self.mesh["cp"] if self.plan.cp > 1 else None
        return cp_step_context(cp_mesh, list(batch), [part.rope for part in self.model_parts])

    def _pipeline_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one pipeline micro-batch: its sum over the step's divisor."""
        return poison(self.loss_fn(pred, labels) / self._norm)

    def _pipeline_run(self, batch: Any, norm: torch.Tensor, *, evaluate: bool = False) -> torch.Tensor:
        """One local batch through the pipeline schedule (forward and backward, or forward only): this
        rank's loss, nonzero on the last stage only."""
        p, self._norm = self.pipeline, norm
        losses: list[torch.Tensor] | None = [] if p.has_last else None
        inputs = (batch.input_ids,) if p.has_first else ()
        run = p.schedule.eval if evaluate else p.schedule.step
        # bf16 without FSDP is autocast: the schedule runs each stage's forward inside this context. Under
        # context parallel the whole step is ring attention, its batch sharded once for all micro-batches.
        with self._cp_step(batch.input_ids, batch.labels), self._autocast():
            run(*inputs, target=batch.labels if p.has_last else None, losses=losses)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([x.detach().float() for x in losses]).sum()

    def _eval_sums(self, batch: Any) -> torch.Tensor:
        """[loss sum, valid tokens] of one validation batch on this rank (counted where the loss is)."""
        one = torch.ones((), device=self.device)
        if self.pipeline is not None:
            total = self._pipeline_run(batch, one, evaluate=True)
            return torch.stack([total, valid_tokens(batch.labels).float() * self.pipeline.has_last])
        inputs, labels, positions, docs, cp_ctx = self._step_inputs(batch)
        with cp_ctx, self._autocast():
            total = self._loss(inputs, labels, positions, docs, one).float()
            return torch.stack([total, valid_tokens(labels).float()])  # (labels: this cp rank's shard)

    def train_step(self, data_iter: Iterator[Any]) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
        """One optimizer step over `accum` micro-batches.

        Returns:
            (this rank's loss, the global gradient norm, data wait seconds, whether the update was applied).
        """
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        batches = [next(data_iter).to(self.device, non_blocking=True) for _ in range(self.plan.accum)]
        data_wait = time.perf_counter() - t0
        self.watchdog.mark("forward and backward")
        dp_group = self.mesh["dp"].get_group() if self.plan.dp > 1 else None  # (tp/cp/pp peers: same labels)
        norm = loss_divisor(
            [b.labels for b in batches], group=dp_group, averaged_over=self.plan.dp * self.plan.cp
        )
        total = torch.zeros((), device=self.device)
        step_fn = self._pipeline_run if self.pipeline is not None else self._forward_backward
        for batch in batches:
            total += step_fn(batch, norm)
        pp_mesh = self.mesh["pp"] if self.pipeline is not None else None
        self.watchdog.mark("gradient norm and optimizer step")
        # With the clip folded into the optimizer (ClipAdamW), only the norm here; its step scales.
        folded = isinstance(self.optimizer, ClipAdamW)
        max_norm = 0.0 if folded else self.plan.max_norm
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm, pp_mesh=pp_mesh)
        # This step's rate (torchao's low-bit AdamW keeps it as a tensor).
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        stepped = self.guard.should_step(self.step, total, grad_norm)
        self.checkpointer.wait_for_staging()  # an async_pinned save may still be copying the weights
        self.balance.step(update=stepped)  # (the experts' load; a skipped step moves no routing bias)
        if stepped:
            if folded:
                self.optimizer.set_clip(grad_norm, self.plan.max_norm)
            self.optimizer.step()
            if self.plan.float8.all_gather:  # FSDP's float8 all-gather: every weight's scale, once per step
                precompute_float8_scales(self.model)
        self.scheduler.step()  # (a skipped step still advances the schedule: it is a function of the step)
        return total, grad_norm, data_wait, stepped

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Summed over the pipeline stages (only the last holds a loss) and the data-parallel and
        context-parallel ranks; the same on every rank."""
        p, mesh = self.plan, self.mesh
        groups = [mesh[d].get_group() for d, n in (("pp", p.pp), ("dp_cp", p.dp * p.cp)) if n > 1]
        return distributed.all_sum(value.detach().float().clone(), groups)

    def train(self, stop_at: int | None = None) -> list[float]:
        """Run the loop to training.steps (or to step `stop_at`, as if the job were cut off there), or
        until a signal stops it (`stopped_by`); return the (window mean) losses of the logged steps.

        Raises:
            NonFiniteError: A non-finite step stopped the run (training.on_nonfinite).
        """
        t = self.cfg.training
        last = t.steps if stop_at is None else min(stop_at, t.steps)
        if t.gc_freq > 0:
            gc.disable()
            gc.collect()
        data_iter = iter(self.train_loader)
        self.throughput = Throughput(self.flops_per_token, self.peak)
        self.signals.install()
        self.watchdog = StepWatchdog(
            t.step_timeout, rank=self.rank, folder=self.run_dir / "hang", backend=distributed.backend()
        )
        self._window, logged = (torch.zeros((), device=self.device), 0), []  # (loss sum, steps) since a log
        try:
            while self.step < last and self.stopped_by is None:
                self.step += 1
                self.watchdog.begin(self.step)  # (a step that does not finish in time ends the job)
                if t.gc_freq > 0 and self.step % t.gc_freq == 0:
                    gc.collect(1)
                for offloader in self.offloaders:  # the traffic of the step about to run
                    offloader.bytes_offloaded = 0
                loss, grad_norm, data_wait, stepped = self.train_step(data_iter)
                with self.watchdog.apart("the profiler"):  # (writing a trace may take a while)
                    self.profiler.step()
                self.throughput.add(self.plan.tokens_per_gpu_step, data_wait)
                if stepped:  # (a skipped step's loss stays out of the window's mean)
                    self._window = (self._window[0] + loss, self._window[1] + 1)
                if self._should_log(self.step):
                    self.watchdog.mark("logging")
                    logged.append(self._log_step(loss, grad_norm))
                with self.watchdog.apart("validation or checkpoint save"):
                    self._validate_and_save()
                if self.step < last:  # (every rank polls at the same boundaries)
                    self.watchdog.mark("the stop-signal agreement")
                    self.stopped_by = self.signals.poll()
                self.watchdog.end()
            self.guard.settle()
            if self.stopped_by is not None:
                self._stop_on_signal()
        except NonFiniteError as e:  # the series of this attempt ends here: say why in it
            self.metrics.log(e.step, {"stop": "non-finite"})
            raise
        finally:
            self.watchdog.close()
            if t.gc_freq > 0:
                gc.enable()
        return logged

    def _log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> float:
        """Log the window's mean loss (`loss`), the last step's (`loss_last`), ...; return the mean."""
        self.guard.settle()  # (logging reads the loss: a host sync here anyway)
        (window, n), self._window = self._window, (torch.zeros((), device=self.device), 0)
        dp_cp = self.plan.dp * self.plan.cp
        mean_sum, last = (self._global_sum(torch.stack([window, loss])) / dp_cp).tolist()
        mean = mean_sum / n if n else float("nan")
        self.last_loss = (self.step, mean)
        record = {"loss": mean, "loss_last": last, "grad_norm": grad_norm.item(), "lr": self.lr}
        if self.guard.skipped:
            record["skipped"], self.guard.skipped = self.guard.skipped, 0
        record |= self.throughput.read()
        record |= dataclasses.asdict(self.memory.read_and_reset())
        if self.offloaders:  # activation offload: GiB this rank moved to the host (and back)
            record["offload_gib"] = sum(o.bytes_offloaded for o in self.offloaders) / 2**30
        self.metrics.log(self.step, record | self.balance.stats())
        self.throughput.reset()
        return mean

    def _validate_and_save(self) -> None:
        """Validation and checkpoints of this step, their time kept out of the training throughput; the
        step's non-finite check is read first, so that no checkpoint holds a non-finite step."""
        t, ck = self.cfg.training, self.cfg.checkpoint
        if self.cfg.validation.freq and self.step % self.cfg.validation.freq == 0:
            self.guard.settle()
            with self.throughput.paused(self.device):
                self.validate()
        due = self.checkpointer.due(self.step, last=self.step == t.steps)
        if due:
            self.guard.settle()
        with self.throughput.paused(self.device) if due else contextlib.nullcontext():
            self.checkpointer.maybe_save(
                self.step,
                last=self.step == t.steps,
                model_only=ck.last_save_model_only,
                dtype=getattr(torch, ck.export_dtype),
            )
        self._log_checkpoint_records()

    def _stop_on_signal(self) -> None:
        """After the step all ranks agreed to stop at: a checkpoint (unless this step's is saved or it is
        switched off), the metrics flushed, and `stop_reason` for the entry point to print."""
        ck = self.cfg.checkpoint
        if ck.enable and ck.save_on_signal:
            if not self.checkpointer.due(self.step, last=self.step == self.cfg.training.steps):
                self.checkpointer.save(self.step)
            self.checkpointer.wait()  # written and renamed before the process may be killed
            self._log_checkpoint_records()
        self.metrics.log(self.step, {"stop": signal.Signals(self.stopped_by).name})
        self.metrics.flush()
        self.stop_reason = stop_message(self.stopped_by, self.step, enable=ck.enable, save=ck.save_on_signal)

    def _should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps

    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over the valid tokens of validation.steps batches of the held-out split (the same
        batches every time), through the training's loss path (chunked, context parallel, pipeline)."""
        t0 = time.perf_counter()
        self.model.eval()
        if self._val_loader is None:  # built once: a validation pass replays the same batches
            self._val_loader = build_dataloader(self.cfg.data, split="validation", **self.loader_args)
        sums = torch.zeros(2, device=self.device)
        with self.memory.apart() as mem:  # its own peak, kept out of the training rows'
            for batch in itertools.islice(self._val_loader, self.cfg.validation.steps):
                sums += self._eval_sums(batch.to(self.device))
            total, count = self._global_sum(sums).tolist()
        self.model.train()
        loss = total / max(count, 1.0)
        self.validations.append((self.step, loss))
        self.metrics.log(
            self.step,
            {
                "val_loss": loss,
                "val_ppl": math.exp(min(loss, 50.0)),
                "val_time_s": time.perf_counter() - t0,
                "val_mem_active_gib": mem[0].mem_active_gib,
            },
        )
        return loss

    def summarize(self, *, started: float, launcher: str, args: list[str], console: Path | None) -> None:
        """After the loop (at training.steps, or stopped by a signal): wait for the save in flight (the
        checkpoint the summary names must be complete), then on rank 0 the run's summary on the console
        and in summary.json (`titanrush.run.summary`).

        Args:
            started: `time.perf_counter()` at the start of the process.
            launcher: How the trainer was started (`summary.command_prefix`).
            args: The trainer's arguments.
            console: The copy of the console in the run folder, if there is one.
        """
        self.checkpointer.wait()
        self._log_checkpoint_records()
        if self.rank != 0:
            return
        s = self._summary(started, launcher, args, console)
        logger.info("\n".join(summary_lines(s)))
        try:
            write_summary(s)
        except OSError as e:
            logger.warning(f"cannot write the summary into {self.run_dir} ({e.strerror}): the console has it")

    def _summary(self, started: float, launcher: str, args: list[str], console: Path | None) -> RunSummary:
        """This attempt's RunSummary (rank 0)."""
        cfg, plan, ck = self.cfg, self.plan, self.cfg.checkpoint
        tokens, seconds = self.throughput.totals()
        tps = tokens / seconds if tokens else None
        tflops = None if tps is None else tps * self.flops_per_token / 1e12
        where = "a CPU" if self.device.type != "cuda" else torch.cuda.get_device_name(self.device)
        peak = self.memory.run_peak
        if peak is not None and peak.mem_reserved_gib is not None:
            mem, pct = peak.mem_reserved_gib, peak.mem_reserved_pct
            mem_note = f"reserved by the CUDA allocator; {peak.mem_active_gib:.2f} GiB allocated"
        else:
            mem, pct = (peak.mem_active_gib, peak.mem_active_pct) if peak is not None else (None, None)
            mem_note = "the process's peak resident memory"
        saved = [s for s in scan(self.run_dir / ck.folder) if s.complete] if ck.enable else []
        full = [s for s in saved if not s.model_only]
        if not cfg.job.overwrite:  # (every next command reuses this folder)
            args = with_setting(args, "job.overwrite")
        return RunSummary(
            attempt=self.attempt,
            first_step=self.start_step + 1,
            last_step=self.step,
            total_steps=cfg.training.steps,
            stopped_by=None if self.stopped_by is None else signal.Signals(self.stopped_by).name,
            devices=self.world_size,
            tokens=(self.step - self.start_step) * plan.local_batch * plan.seq_len * plan.accum * plan.dp,
            wall_s=time.perf_counter() - started,
            setup_s=self.setup_s,
            train_s=seconds,
            tps=tps,
            tflops=tflops,
            mfu=None if tflops is None or not self.peak else 100 * tflops / self.peak,
            mfu_note=f"no peak TFLOP/s for {where} (set metrics.peak_tflops)",
            mem_gib=mem,
            mem_pct=pct,
            mem_note=mem_note,
            mem_of="GPU" if self.device.type == "cuda" else "host's memory",
            loss=None if self.last_loss is None else self.last_loss[1],
            loss_step=None if self.last_loss is None else self.last_loss[0],
            validation=list(self.validations),
            run_dir=self.run_dir,
            checkpoint=saved[-1].path if saved else None,
            resumable=full[-1].path if full else None,
            checkpoint_enable=ck.enable,
            checkpoint_interval=ck.interval,
            tensorboard=self.run_dir / "tb" if cfg.metrics.tensorboard else None,
            wandb=self.wandb_where,
            console=console,
            dense=not isinstance(plan.args, Llama4Args),
            launcher=launcher,
            args=args,
        )

    def _log_checkpoint_records(self) -> None:
        """Log the timings of the saves that completed (and of a resume): own rows, no `loss`."""
        for step, values in self.checkpointer.records:
            self.metrics.log(step, values)
        self.checkpointer.records.clear()

    def close(self, *, end_process_group: bool = True) -> None:
        """Wait for a save in flight, flush the metrics, let the run folder go, end the process group
        (`end_process_group` false: keep it for the next trainer of this process: the probe's)."""
        self.profiler.close()
        self.checkpointer.close()  # waits for a save in flight
        self._log_checkpoint_records()
        self.metrics.close()
        self.signals.close()
        self.lock.release()
        if end_process_group:
            distributed.destroy()
