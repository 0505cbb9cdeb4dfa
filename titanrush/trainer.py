"""The trainer: builds everything from the config in one documented order, then runs the loop.

Build order (each step only sees the values it needs):
 0. check_config: every check that needs no allocation (degrees, tokenizer vs vocabulary, seq_len,
    combinations of options, the attention backend), so bad input fails before anything is built
 1. distributed init, device and the DeviceMesh
 2. the tokenizer, the model on the meta device -> (pipeline stages ->) parallelize_llama (float8 -> TP ->
    CP -> AC -> compile -> FSDP/DDP) -> to_empty on the device -> init_weights(seed), identical
    whatever the mesh
 3. optimizer and LR schedule; data loaders; checkpoint manager (resumes if a checkpoint exists)
 4. metrics (console, metrics.jsonl, TensorBoard), the profiler, and the loop
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
from titanrush.checkpoint import CheckpointManager, barrier, from_rank0
from titanrush.config import ConfigError, JobConfig
from titanrush.data import build_dataloader, build_tokenizer
from titanrush.metrics import (
    MemoryMonitor,
    MetricsLogger,
    Throughput,
    flops_per_token,
    matmul_params,
    peak_tflops,
)
from titanrush.models.flash_warm_up import WarmUpProcess, rank_shapes
from titanrush.models.llama import FLAVORS, Llama, ModelArgs, model_args
from titanrush.models.llama.attention import FlashShapes, flash_installed, prepare_flash_in_background
from titanrush.models.llama.loss import cross_entropy
from titanrush.models.llama.parallelize import check_combinations, parallelize_llama
from titanrush.models.llama.pipeline import PipelinedLlama, pipeline_llama
from titanrush.optim import build_lr_scheduler, build_optimizer
from titanrush.parallel.activation_offload import bind_near_gpu
from titanrush.parallel.compile import start_compile_workers
from titanrush.parallel.context_parallel import context_parallel_step, set_rotate_method
from titanrush.parallel.float8 import float8_scales_over, precompute_float8_scales
from titanrush.parallel.grad_clip import clip_coefficient, clip_grad_norm_
from titanrush.parallel.parallel_dims import ParallelDims
from titanrush.parallel.pipeline import check_explicit_split, stages_per_rank
from titanrush.parallel.step_overlap import OverlappedStep, param_groups
from titanrush.parallel.tensor_parallel import loss_parallel_context
from titanrush.profiling import Profiler

logger = logging.getLogger("titanrush")


def resolve_model_args(cfg: JobConfig, tokenizer_words: int) -> ModelArgs:
    """The flavor's arguments with the config's overrides; every mismatch is a ConfigError."""
    m, t = cfg.model, cfg.training
    if m.flavor not in FLAVORS:
        import difflib

        lower = {f.lower(): f for f in FLAVORS}
        near = [lower[m.flavor.lower()]] if m.flavor.lower() in lower else []
        near = near or difflib.get_close_matches(m.flavor, list(FLAVORS), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"model.flavor = {m.flavor!r} is not one of {', '.join(FLAVORS)}{hint}")
    over: dict[str, Any] = {"attn_backend": m.attn_backend, "flash_in_graph": m.flash_in_graph}
    over["rope_positions"] = t.seq_len  # (training and validation batches: no longer sequence)
    if m.vocab_size:
        over["vocab_size"] = m.vocab_size
    if m.tie_embeddings != "flavor":
        over["tie_embeddings"] = m.tie_embeddings == "tied"
    if t.loss == "chunked":
        over["loss_chunk_size"] = t.loss_chunk_size
        over["compile_loss"] = cfg.compile.enable
    args = model_args(m.flavor, **over)
    if args.vocab_size < tokenizer_words:
        raise ConfigError(
            f"model vocabulary ({args.vocab_size}) does not cover the tokenizer's {tokenizer_words} tokens; "
            f"set model.vocab_size >= {tokenizer_words} or use a tokenizer that fits"
        )
    if t.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {t.seq_len} exceeds the {m.flavor} model's maximum of {args.max_seq_len}"
        )
    return args


def check_config(cfg: JobConfig, world_size: int) -> tuple[ParallelDims, ModelArgs, int]:
    """Every check that needs no allocation: mesh degrees, model fit, batch arithmetic.

    Returns the parallel dims, the model arguments and the gradient accumulation steps.
    """
    p = cfg.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, world_size)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    args = resolve_model_args(cfg, tokenizer.n_words)
    dims.check_model(
        n_heads=args.n_heads, n_kv_heads=args.kv_heads, n_layers=args.n_layers, seq_len=cfg.training.seq_len
    )
    check_ac_blocks(cfg, args)
    t = cfg.training
    per_step = t.local_batch_size * dims.dp
    gbs = per_step if t.global_batch_size == -1 else t.global_batch_size
    if gbs % per_step:
        raise ConfigError(
            f"training.global_batch_size = {gbs} must be a multiple of local_batch_size x dp = "
            f"{t.local_batch_size} x {dims.dp} = {per_step}"
        )
    if p.cp > 1:
        if not torch.cuda.is_available():
            raise ConfigError(
                "parallelism.cp > 1 needs CUDA GPUs (ring attention runs on SDPA's GPU kernels)"
            )
        if cfg.model.attn_backend not in ("sdpa", "cudnn"):
            raise ConfigError(
                "parallelism.cp > 1 needs model.attn_backend = 'sdpa' or 'cudnn', "
                f"not {cfg.model.attn_backend!r}"
            )
        if p.pp > 1:
            raise ConfigError("parallelism.cp > 1 with parallelism.pp > 1 is not supported yet")
    _check_combinations(cfg, dims, args)
    _check_attention(cfg.model.attn_backend)
    if cfg.activation_checkpoint.offload_first and not torch.cuda.is_available():
        raise ConfigError(
            "activation_checkpoint.offload_first needs a CUDA GPU (it moves activations to host memory); "
            "set it to 0 here"
        )
    if cfg.float8.enable and cfg.training.precision != "bf16":
        raise ConfigError("float8.enable needs training.precision = 'bf16'")
    if cfg.compile.enable is False and p.async_tp:
        raise ConfigError("parallelism.async_tp needs compile.enable = true")
    return dims, args, gbs // per_step


def flash_shapes(
    cfg: JobConfig, dims: ParallelDims, args: ModelArgs, device: torch.device
) -> FlashShapes | None:
    """This rank's attention inputs in training, for flash-attn-4's warm-up (`flash_warm_up.rank_shapes`;
    `titanrush.train --flash-warm-up` works out the same from the config's fields)."""
    t = cfg.training
    return rank_shapes(
        args, device=device, batch=t.local_batch_size, seq_len=t.seq_len, tp=dims.tp, pp=dims.pp, cp=dims.cp,
        in_graph=cfg.model.flash_in_graph,
    )  # fmt: skip


def _check_attention(backend: str) -> None:
    """The attention backend can run here: its package imports, its kernels exist on this device."""
    if backend == "flash" and not flash_installed():  # (found, not imported: see prepare_flash_in_background)
        raise ConfigError(
            "model.attn_backend = 'flash' needs the flash-attn package (pip install flash-attn, or the "
            "flash-attn-4 / FA3 hopper build); use attn_backend = 'sdpa' or 'cudnn' without it"
        )
    if backend in ("flex", "cudnn") and not torch.cuda.is_available():
        why = (
            "FlexAttention has no backward on CPU" if backend == "flex" else "cuDNN attention is a GPU kernel"
        )
        raise ConfigError(
            f"model.attn_backend = {backend!r} needs a CUDA GPU for training ({why}); use 'sdpa'"
        )


def _check_combinations(cfg: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    """Combinations of options that cannot work together, named before anything is built."""
    p = cfg.parallelism
    if dims.pp > 1:
        if args.tie_embeddings:
            raise ConfigError(
                "parallelism.pp > 1 cannot tie the embedding (first stage) to the output projection (last "
                "stage); set model.tie_embeddings = 'untied'"
            )
        if args.loss_chunk_size > 0:
            raise ConfigError("training.loss = chunked does not compose with parallelism.pp > 1; use 'plain'")
        n_stages = p.pp * stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
        microbatches = p.pp_microbatches or n_stages
        if cfg.training.local_batch_size % microbatches:
            raise ConfigError(
                f"training.local_batch_size = {cfg.training.local_batch_size} must be divisible by the "
                f"pipeline's {microbatches} micro-batches (parallelism.pp_microbatches, default pp x stages "
                "per rank)"
            )
        if microbatches < p.pp:
            raise ConfigError(f"parallelism.pp_microbatches = {microbatches} must be >= pp = {p.pp}")
        if p.pp_layers_per_stage:
            check_explicit_split(p.pp_layers_per_stage, args.n_layers, n_stages)
    check_combinations(dims, loss_chunk_size=args.loss_chunk_size, cpu_offload=p.fsdp_cpu_offload)
    if cfg.optimizer.overlap_step:
        why = (
            "it steps FSDP's units" if not dims.fsdp_enabled
            else "pipeline stages step their own parts" if dims.pp > 1
            else "FSDP's CPU offload keeps the gradients on the host" if p.fsdp_cpu_offload
            else "torchao's low-bit AdamW" if cfg.optimizer.name != "adamw"
            else None
        )  # fmt: skip
        if why:
            raise ConfigError(
                f"optimizer.overlap_step needs FSDP without pipelining or CPU offload, with optimizer.name = "
                f"'adamw' ({why}); set optimizer.overlap_step = false"
            )


def check_ac_blocks(cfg: JobConfig, args: ModelArgs) -> None:
    """`activation_checkpoint.op_all_last` and `offload_first` count blocks of the model: at most its
    number of blocks."""
    ac = cfg.activation_checkpoint
    for key, count in (("op_all_last", ac.op_all_last), ("offload_first", ac.offload_first)):
        if count > args.n_layers:
            raise ConfigError(
                f"activation_checkpoint.{key} = {count}: the {cfg.model.flavor} model has {args.n_layers} "
                f"blocks; use 0..{args.n_layers}"
            )


def set_allocator(*, expandable: bool, pin_threads: int = 0) -> None:
    """The CUDA caching allocator's segments: expandable unless the environment configures the allocator;
    with `pin_threads`, pinned host memory from malloc + cudaHostRegister, its pages touched by that many
    threads."""
    env = [k for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if os.environ.get(k)]
    pinned = ["pinned_use_cuda_host_register:True", f"pinned_num_register_threads:{pin_threads}"]
    if env:
        logger.info(f"allocator: {env[0]}={os.environ[env[0]]} (training.expandable_segments not applied)")
        if not pin_threads or "pinned_" in os.environ[env[0]]:
            return
        # Each call resets the keys it does not name to their defaults: repeat the environment's.
        settings = [os.environ[env[0]], *pinned]
    else:
        settings = [f"expandable_segments:{expandable}", *(pinned if pin_threads else [])]
    setting = ",".join(settings)
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.12
    if set_settings is not None:
        set_settings(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)


def nccl_settings(environ: dict[str, str] | os._Environ, *, max_ctas: int) -> None:
    """NCCL's settings that titanrush's config sets, as the environment variables NCCL reads when a
    communicator starts; a variable already set wins."""
    if max_ctas > 0:
        environ.setdefault("NCCL_MAX_CTAS", str(max_ctas))


class Trainer:
    """Owns the model, optimizer, data and metrics of one run."""

    def __init__(self, cfg: JobConfig, flash_child: WarmUpProcess | None = None) -> None:
        """`flash_child`: flash-attn-4's warm-up child that `titanrush.train` started at launch."""
        self.cfg = cfg
        marks = [("start", time.perf_counter())]  # set-up stages, logged with their durations at the end
        # 1. Distributed init and mesh.
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.dims, self.model_args, self.accum = check_config(cfg, self.world_size)
        if cfg.compile.enable:  # the compile workers start up beside everything below (before any
            # NUMA binding narrows this process's CPUs: the share is of the whole host's cores)
            ranks_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            start_compile_workers(cfg.compile.workers, ranks_per_host=ranks_per_host)
        if torch.cuda.is_available():
            self.device = torch.device("cuda", local_rank)
            ac = cfg.activation_checkpoint
            pin_threads = ac.offload_pin_threads if ac.offload_first > 0 else 0
            set_allocator(expandable=cfg.training.expandable_segments, pin_threads=pin_threads)
            torch.cuda.set_device(self.device)
            if cfg.model.attn_backend == "flash":  # its import and FA4's kernels beside the set-up below
                shapes = flash_shapes(cfg, self.dims, self.model_args, self.device)
                prepare_flash_in_background(shapes, started=flash_child)
            if ac.offload_first > 0:  # pinned host memory next to this GPU
                cpus = bind_near_gpu(self.device)
                if cpus is not None:
                    logger.info(f"activation offload: bound to the GPU's {len(cpus)} NUMA-local CPUs")
        else:
            self.device = torch.device("cpu")
        if self.world_size > 1 and not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if backend == "nccl":
                nccl_settings(os.environ, max_ctas=cfg.parallelism.nccl_max_ctas)
            # No device_id: each group's NCCL communicator starts at its first collective, so the mesh's
            # groups that nothing uses (size-1 dimensions, flattened views of the same ranks) never start
            # one, and the set-up does not wait for them.
            dist.init_process_group(backend)
        marks.append(("config and process group", time.perf_counter()))
        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        marks.append(("mesh", time.perf_counter()))
        self.run_dir = self._prepare_run_dir()
        if self.dims.cp > 1:
            set_rotate_method(cfg.parallelism.cp_rotate_method)
        _set_determinism(cfg.training)
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None and self.dims.dp > 1 else 0

        # 2-3. Model: meta -> parallelize -> materialize -> init.
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        with torch.device("meta"):
            model = Llama(self.model_args)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = flops_per_token(self.model_args, matmul_params(model), cfg.training.seq_len)
        marks.append(("tokenizer and model on meta", time.perf_counter()))
        parallelism = cfg.parallelism
        if self.dims.pp > 1 and parallelism.fsdp_reshard_after_forward == "default":
            # Each micro-batch runs forward again: re-gathering the weights for each would cost more than
            # it saves, so pipelined stages keep them gathered until backward (ZeRO-2).
            parallelism = dataclasses.replace(parallelism, fsdp_reshard_after_forward="never")

        def parallelize(module: torch.nn.Module) -> torch.nn.Module:
            return parallelize_llama(
                module,
                self.dims,
                self.mesh,
                parallelism=parallelism,
                compile=cfg.compile,
                ac=cfg.activation_checkpoint,
                float8=cfg.float8,
                precision=cfg.training.precision,
                device=self.device,
            )

        self.pipeline: PipelinedLlama | None = None
        if self.dims.pp > 1:
            self.pipeline = pipeline_llama(
                model,
                pp_rank=self.mesh["pp"].get_local_rank(),
                pp_mesh=self.mesh["pp"],
                parallelism=cfg.parallelism,
                local_batch_size=cfg.training.local_batch_size,
                device=self.device,
                loss_fn=self._pipeline_loss,
                parallelize=parallelize,
            )
            self.model_parts = self.pipeline.parts
            model = self.pipeline.view
            sizes = self.pipeline.layers_per_stage
            logger.info(f"pipeline: {cfg.parallelism.pp_schedule}, layers per stage {sizes}")
        else:
            model = parallelize(model)
            self.model_parts = [model]
        marks.append(("parallelize", time.perf_counter()))
        self.offloaders = [o for p in self.model_parts if (o := getattr(p, "activation_offloader", None))]
        # FSDP's CPU offload keeps the sharded parameters in host memory (buffers stay on the device).
        param_device = torch.device("cpu") if cfg.parallelism.fsdp_cpu_offload else self.device
        for part in self.model_parts:
            part.to_empty(device=param_device)
            part.init_weights(seed=cfg.training.seed, buffer_device=self.device)
            part.train()
        marks.append(("weights materialized and initialized", time.perf_counter()))
        self.model = model
        # The loss (log-softmax over the vocabulary in fp32) fuses well; under loss parallel it works on
        # DTensors, which stay eager.
        loss_parallel = self.dims.tp > 1 and cfg.parallelism.loss_parallel
        compile_loss = cfg.compile.enable and not loss_parallel
        self.loss_fn = torch.compile(cross_entropy) if compile_loss else cross_entropy
        f8 = cfg.float8
        # FSDP's float8 all-gather needs every weight's scale computed once after each optimizer step.
        self.float8_precompute = (
            f8.enable and f8.recipe == "tensorwise" and f8.fsdp_float8_all_gather and self.dims.fsdp_enabled
        )
        self.autocast = (
            cfg.training.precision == "bf16" and not self.dims.fsdp_enabled
        )  # FSDP casts through its MixedPrecisionPolicy
        marks.append(("loss", time.perf_counter()))

        # 4. Optimizer, schedule, data.
        o = cfg.optimizer
        units = None
        if o.overlap_step:  # (check_config allowed it for FSDP only, which records its units)
            units = model.fsdp_units
        self.optimizer = build_optimizer(
            param_groups(units, model) if units is not None else model.parameters(),
            name=o.name,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            implementation=o.implementation,
        )
        self.step_overlap = None
        if units is not None:  # the step unit by unit, beside the next forward
            scales, beside = (precompute_float8_scales if self.float8_precompute else None), False
            if self.float8_precompute and self.dims.dp_shard * self.dims.cp == self.world_size:
                # FSDP's mesh is every rank: the scales' all-reduce gets a group of its own (see
                # float8_scales_over), so it runs on the side stream right after each unit's update
                scales, beside = float8_scales_over(dist.new_group()), True
            self.step_overlap = OverlappedStep(
                self.optimizer, root=model, units=units, scales=scales, scales_beside=beside
            )
        s = cfg.lr_scheduler
        self.scheduler = build_lr_scheduler(
            self.optimizer,
            warmup_steps=s.warmup_steps,
            total_steps=cfg.training.steps,
            decay=s.decay,
            decay_ratio=s.decay_ratio,
            min_lr_factor=s.min_lr_factor,
        )
        loader_args = dict(
            tokenizer=self.tokenizer,
            seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size,
            dp_rank=dp_rank,
            dp_degree=self.dims.dp,
            seed=cfg.training.seed,
            vocab_size=self.model_args.vocab_size,
        )
        marks.append(("optimizer", time.perf_counter()))
        self.train_loader = build_dataloader(cfg.data, split="train", **loader_args)
        marks.append(("data", time.perf_counter()))
        self.val_loader_args = loader_args
        self._val_loader: Any = None
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
            # (the RoPE table's length is this run's, not the model's: a model rebuilt from the
            # checkpoint gets the full table)
            info={
                "flavor": cfg.model.flavor,
                "model_args": dataclasses.asdict(dataclasses.replace(self.model_args, rope_positions=0)),
            },
            rank=self.rank,
        )
        self.step = self.checkpointer.resume(load_path=ck.load_path, model_only=ck.load_model_only)

        # 5. Metrics.
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
        # Each token is counted once per data-parallel replica, spread over the GPUs of that replica.
        self.tokens_per_gpu_step = (
            cfg.training.local_batch_size
            * cfg.training.seq_len
            * self.accum
            / self.dims.non_data_parallel_size
        )
        marks.append(("checkpoint, metrics, profiler", time.perf_counter()))
        self._log_header()
        stages = ", ".join(f"{name} {t1 - t0:.1f}" for (_, t0), (name, t1) in itertools.pairwise(marks))
        age = _process_age()
        before = f" (the process started {age - (marks[-1][1] - marks[0][1]):.1f} s before it)" if age else ""
        logger.info(f"set-up {marks[-1][1] - marks[0][1]:.1f} s{before}: {stages}")

    # ------------------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> Path:
        """Rank 0 makes the run folder and every rank gets its outcome (a refused folder stops them all);
        then the ranks meet. That barrier starts NCCL's first communicator, whose one-time costs (about
        a second, measured) this rank's flash-attn import runs beside; left to the first all-gather of
        step 1 they cost more (3.5 s, AS-9 in docs/benchmarks/performance.md)."""
        run_dir = Path(self.cfg.job.dump_folder) / self.cfg.job.name
        error = ""
        if self.rank == 0:
            if run_dir.exists() and not self.cfg.job.overwrite:
                error = f"run folder {run_dir} exists and job.overwrite = false; choose another job.name"
            else:
                try:
                    run_dir.mkdir(parents=True, exist_ok=True)
                    (run_dir / "config.toml").write_text(cfgmod.to_toml(self.cfg))
                except OSError as e:
                    error = f"cannot write the run folder {run_dir} ({e}); choose another job.dump_folder"
        error = from_rank0("run_dir", error)
        if error:
            raise ConfigError(error)
        barrier()
        return run_dir

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
        a, t = self.model_args, self.cfg.training
        logger.info(
            f"titanrush: {self.cfg.model.flavor} ({self.n_params / 1e6:,.1f}M params, {a.n_layers} layers, "
            f"dim {a.dim}) on {self.world_size} x {self.device.type}; "
            f"mesh dp_replicate={self.dims.dp_replicate} "
            f"dp_shard={self.dims.dp_shard} cp={self.dims.cp} tp={self.dims.tp} pp={self.dims.pp}"
        )
        logger.info(
            f"batch: local {t.local_batch_size} x seq {t.seq_len}, accumulation {self.accum}, "
            f"global {t.local_batch_size * self.dims.dp * self.accum}; "
            f"{self.flops_per_token / 1e9:.3f} GFLOP/token; "
            f"run folder {self.run_dir}"
        )

    # ------------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast where no FSDP mixed-precision policy does the casting."""
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _document_inputs(self, batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(position_ids, document_ids) for the model: with flex attention, block-causal attention within
        each document and positions restarting at each document start; else plain causal attention."""
        if self.model_args.attn_backend == "flex":
            return batch.position_ids, batch.document_ids
        return None, None

    def _forward_backward(self, batch: Any) -> torch.Tensor:
        """Loss of one micro-batch (divided by the accumulation steps), with backward done."""
        ctx = self._autocast()
        chunked = self.model_args.loss_chunk_size > 0
        inputs, labels = batch.input_ids, batch.labels
        positions, docs = self._document_inputs(batch)
        cp_ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.dims.cp > 1:
            # Positions are sharded with the tokens, so each shard's RoPE uses its tokens' true positions.
            positions = torch.arange(inputs.shape[1], device=self.device).expand_as(inputs).contiguous()
            cp_ctx = context_parallel_step(self.mesh["cp"], [inputs, labels, positions])
        with cp_ctx, loss_parallel_context(self.mesh, self.dims, self.cfg.parallelism):
            with ctx:  # autocast covers the forward and the loss; backward runs outside it, which frees
                # autocast's cache of bf16 weight copies as soon as backward is done with each one
                if chunked:
                    loss = self.model(inputs, position_ids=positions, document_ids=docs, labels=labels)
                else:
                    loss = self.loss_fn(self.model(inputs, position_ids=positions, document_ids=docs), labels)
                loss = loss / self.accum
            loss.backward()
        # Under loss parallel the loss is a replicated DTensor: its local value is the loss.
        return _local(loss.detach())

    def _pipeline_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss per pipeline micro-batch, scaled so that a step's losses sum to the mean."""
        loss = self.loss_fn(pred, labels)
        return loss / (self.pipeline.microbatches * self.accum)

    def _pipeline_forward_backward(self, batch: Any) -> torch.Tensor:
        """One local batch through the pipeline schedule; the loss is nonzero on the last stage only."""
        p = self.pipeline
        losses: list[torch.Tensor] | None = [] if p.has_last else None
        target = batch.labels if p.has_last else None
        # bf16 without FSDP is autocast: the schedule runs each stage's forward inside this context.
        with self._autocast(), loss_parallel_context(self.mesh, self.dims, self.cfg.parallelism):
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
        with (
            torch.no_grad(),
            self._autocast(),
            loss_parallel_context(self.mesh, self.dims, self.cfg.parallelism),
        ):
            if hasattr(p.schedule, "eval"):
                p.schedule.eval(*inputs, target=target, losses=losses)
            else:  # torch versions without Schedule.eval: the same switch by hand
                p.schedule._has_backward = False
                try:
                    p.schedule.step(*inputs, target=target, losses=losses)
                finally:
                    p.schedule._has_backward = True
        if not losses:
            return torch.zeros((), device=self.device)
        return _local(torch.stack([x.detach().float() for x in losses]).sum() * self.accum)

    def train_step(self, data_iter: Iterator[Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum` micro-batches; returns (loss, grad norm, data wait seconds)."""
        if self.step_overlap is None:  # (the overlapped step frees each unit's as the forward reaches it)
            self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        data_wait = 0.0
        step_fn = self._pipeline_forward_backward if self.pipeline is not None else self._forward_backward
        for _ in range(self.accum):
            t0 = time.perf_counter()
            batch = next(data_iter).to(self.device, non_blocking=True)
            data_wait += time.perf_counter() - t0
            total += step_fn(batch)
        pp_mesh = self.mesh["pp"] if self.pipeline is not None else None
        max_norm = self.cfg.training.max_norm
        overlap = self.step_overlap
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm, pp_mesh=pp_mesh, scale=overlap is None)
        # This step's rate (torchao's low-bit AdamW keeps it as a tensor).
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        self.checkpointer.wait_for_staging()  # an async_pinned save may still be copying the weights
        if overlap is not None:  # each unit's update (and float8 scales) awaited by its next all-gather
            overlap.step(clip_coefficient(grad_norm, max_norm) if max_norm > 0 else None)
        else:
            self.optimizer.step()
            if self.float8_precompute:
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
        if self.dims.pp > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh["pp"].get_group())
        if self.dims.dp * self.dims.cp == 1:
            return value.item()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh["dp_cp"].get_group())
        return value.item() / (self.dims.dp * self.dims.cp)

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
            throughput.add(self.tokens_per_gpu_step, data_wait)
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
                }
                if self.offloaders:  # activation offload: GiB this rank moved to the host (and back)
                    record["offload_gib"] = sum(o.bytes_offloaded for o in self.offloaders) / 2**30
                self.metrics.log(self.step, record)
                throughput.reset()
            validate = bool(self.cfg.validation.freq) and self.step % self.cfg.validation.freq == 0
            if self.step_overlap is not None and (
                validate or self.step == last or self.checkpointer.due(self.step, last=self.step == t.steps)
            ):
                self.step_overlap.finish()  # the parameters are read before the next forward
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
            self._val_loader = build_dataloader(self.cfg.data, split="validation", **self.val_loader_args)
        total = torch.zeros((), device=self.device)
        n = 0
        for batch in itertools.islice(self._val_loader, self.cfg.validation.steps):
            batch = batch.to(self.device)
            n += 1
            if self.pipeline is not None:
                total += self._pipeline_eval(batch)
                continue
            with self._autocast(), loss_parallel_context(self.mesh, self.dims, self.cfg.parallelism):
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
        if dist.is_initialized():
            dist.destroy_process_group()
            # Free the process groups that the mesh and DTensors still reference now: left to interpreter
            # shutdown, gloo's aborts the process now and then ("terminate called without an active
            # exception", seen in about 1 run in 10 on CPU with a DeviceMesh).
            gc.collect()


def _process_age() -> float | None:
    """Seconds since this process started (Linux's /proc), or None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks
    except (OSError, ValueError, IndexError):
        return None


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
