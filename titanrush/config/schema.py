"""The job configuration's schema: one dataclass per TOML section, and `JobConfig`, which holds them all.

This is the file to read to find a key: every field carries its type, its default and a docstring (the
string literal under it). `--help` (`titanrush.config.help`) and docs/config.md
(`scripts/gen_config_doc.py`) print those docstrings from this file's source. A config is built from
defaults < TOML < command line by `titanrush.config.loader.load`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """Bad user input in the config: the message names the key and the fix."""


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder under which each run gets its own folder `<dump_folder>/<name>`."""
    name: str = ""
    """Name of this run; its files go to `<dump_folder>/<name>`. Not set: the model's flavor (`debug`,
    `llama4_debug`, ...), so that runs of different models never share a folder."""
    description: str = "debug model on the embedded corpus"
    """Free text, printed at start-up (any characters; written to the run's config.toml escaped)."""
    overwrite: bool = True
    """Reuse an existing run folder: the run is a new attempt there (its metrics rows carry `attempt`,
    TensorBoard goes to tb/attempt-<n>; docs/operations.md). False refuses a folder that exists."""
    max_restarts: int = 0
    """How many times the launcher (a job of several processes: run_train.sh with NGPU > 1 or NNODES > 1)
    starts the job again after a failure: a worker killed or crashed, a lost peer, a hang (exit status
    4). Each restart resumes from the newest complete checkpoint (from step 1 without checkpoint.enable)
    and is logged with its cause (a console line, a metrics.jsonl row). A config error (2), a non-finite
    stop (3) and a stop by signal (128 + N) are never restarted. docs/operations.md."""
    collective_timeout: float = 1800.0
    """Seconds a collective may wait for the other ranks before it fails: the default process group's
    (init_process_group's timeout) and every group of the mesh, under gloo and NCCL alike. The step
    watchdog (training.step_timeout) ends a hang with stacks and a line, often first."""


@dataclass
class Model:
    flavor: str = "debug"
    """Model size: debug, 1B, 3B, 8B, 70B, 405B (Llama 3.x shapes); llama4_debug, llama4_1Bx8E,
    llama4_1Bx16E, llama4_17Bx16E, llama4_17Bx128E (Llama 4 mixture of experts: see [moe]); or custom
    (a Llama 3 shape): the shape from model.from_checkpoint and/or the dimension keys below (dim,
    n_layers, n_heads, ...)."""
    from_checkpoint: str = ""
    """custom: take every shape field from a titanrush checkpoint (a step folder, its checkpoint folder,
    or a `titanrush convert --from-hf` output: titanrush.json's model_args) or a Hugging Face Llama folder
    (its config.json); the dimension keys below that are set override it."""
    attn_backend: Literal["sdpa", "cudnn", "flash", "flex", "math"] = "sdpa"
    """Attention kernel: sdpa (PyTorch picks; grouped K/V heads), cudnn, flash (the flash-attn package:
    FA4 as an operator inside compiled blocks; FA3 or FA2 between the block's graphs under compile), flex
    (block-causal FlexAttention over document boundaries), math (the unfused baseline)."""
    vocab_size: int = 0
    """Override the flavor's vocabulary size (0 keeps the flavor's). Must cover the tokenizer's. custom
    without model.from_checkpoint: required."""
    tie_embeddings: Literal["flavor", "tied", "untied"] = "flavor"
    """Share the input embedding with the output projection: `flavor` keeps the flavor's choice (custom:
    the checkpoint's, else untied)."""
    max_seq_len: int = 0
    """Override the longest sequence the model is for (its max_seq_len; training.seq_len may not exceed
    it); 0 keeps the flavor's (custom: the checkpoint's, else 2048)."""
    dim: int = 0
    """custom: model width (hidden size); required without model.from_checkpoint; 0 keeps the checkpoint's."""
    n_layers: int = 0
    """custom: transformer blocks; required without model.from_checkpoint; 0 keeps the checkpoint's."""
    n_heads: int = 0
    """custom: attention (query) heads, dividing dim; required without model.from_checkpoint."""
    n_kv_heads: int = 0
    """custom: key/value heads (grouped-query attention), dividing n_heads; 0 keeps the checkpoint's, else
    n_heads."""
    ffn_hidden: int = 0
    """custom: the SwiGLU width exactly (Hugging Face's intermediate_size); instead of multiple_of and
    ffn_dim_multiplier. 0: those two decide (or the checkpoint)."""
    multiple_of: int = 0
    """custom: the SwiGLU width is int(8 dim / 3 x ffn_dim_multiplier) rounded up to a multiple of this
    (Meta's sizing); 0 keeps the checkpoint's, else 256."""
    ffn_dim_multiplier: float = 0.0
    """custom: see multiple_of; 0 keeps the checkpoint's, else none (1)."""
    norm_eps: float = 0.0
    """custom: RMSNorm epsilon; 0 keeps the checkpoint's, else 1e-5."""
    rope_theta: float = 0.0
    """custom: RoPE base; 0 keeps the checkpoint's, else 500000 (Llama 3)."""
    rope_scaling: Literal["flavor", "none", "llama3"] = "flavor"
    """custom: RoPE frequency scaling: none, or llama3 (Llama 3.1's long-context scaling, with the four
    keys below); `flavor` keeps the checkpoint's (none without one)."""
    rope_scale_factor: float = 0.0
    """custom, llama3 scaling: the factor long wavelengths are stretched by; 0 keeps the checkpoint's,
    else 8."""
    rope_low_freq_factor: float = 0.0
    """custom, llama3 scaling: low_freq_factor; 0 keeps the checkpoint's, else 1."""
    rope_high_freq_factor: float = 0.0
    """custom, llama3 scaling: high_freq_factor; 0 keeps the checkpoint's, else 4."""
    rope_original_max_len: int = 0
    """custom, llama3 scaling: the context length before scaling (original_max_position_embeddings); 0
    keeps the checkpoint's, else 8192."""


@dataclass
class Training:
    steps: int = 40
    """Number of optimizer steps."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1 = local_batch_size x dp degree.
    A multiple of that product turns on gradient accumulation."""
    seq_len: int = 256
    """Tokens per sequence; at most the flavor's max_seq_len."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 mixed precision (bf16 compute, fp32 master weights and gradient reduction)."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 42
    """Seed for weights and data order; the same seed gives the same weights."""
    deterministic: bool = False
    """Use deterministic algorithms (slower; for bitwise-reproducible tests)."""
    loss: Literal["plain", "chunked", "auto"] = "plain"
    """Cross-entropy: plain (full logits, fp32 unless compiled) or chunked (the output projection and the
    loss fused, both gradients computed in forward one token chunk at a time: no full logits, no
    recomputation; 8B FSDP4 compiled: 3.6 GiB less at the same speed); auto: the planner picks (chunked
    where the memory it saves lets a faster plan fit; [plan], docs/auto_plan.md)."""
    loss_chunk_size: int = 4096
    """Tokens per chunk when training.loss = chunked."""
    expandable_segments: bool = True
    """CUDA: let the caching allocator grow its segments in place (`expandable_segments:True`, as
    torchtitan's launcher sets it): far less memory reserved beyond what is allocated. Set through
    PYTORCH_ALLOC_CONF before the first CUDA allocation; ignored where PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF is already set (that wins)."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (it is off from launch, through the set-up and in
    between); 0 leaves it automatic."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a step whose loss or global gradient norm is NaN or infinite does: stop (the run ends with
    exit status 3 and a line naming the step, before any checkpoint of it is written) or skip (that
    step's optimizer update is not applied, the weights stay as they were). See docs/operations.md."""
    max_skips: int = 10
    """With on_nonfinite = skip: the most steps in a row that may be skipped; one more non-finite step
    in a row stops the run as `stop` would."""
    step_timeout: float = 0.0
    """Seconds a training step may take before the run is declared hung: every rank writes its stacks
    (and the collectives it waits in) to <run folder>/hang/ and the job ends with exit status 4 and a
    line naming the rank that stalled. 0 derives it: 10 x the median step time (at least 120 s) once 5
    steps are measured, 600 s before. An attempt's first step (compilation) is given at least 600 s, a
    validation pass or checkpoint save 1800 s. docs/operations.md."""


@dataclass
class Optimizer:
    name: Literal["adamw", "adamw8bit", "adamw4bit"] = "adamw"
    """adamw (torch), adamw8bit / adamw4bit (torchao low-bit optimizer states)."""
    lr: float = 3e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["fused_clip", "fused", "foreach", "for-loop"] = "fused_clip"
    """AdamW kernel: fused_clip (ours: the gradient clip folded into one Triton kernel per parameter, which
    reads each gradient once; CUDA with fp32 parameters, else fused), fused (torch's one kernel, the clip
    a pass of its own), foreach (multi-tensor), for-loop (one tensor at a time)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 5
    """Linear warmup from ~0 to optimizer.lr over this many steps; keep it below training.steps (a warm-up
    as long as the run never reaches the peak nor decays: `titanrush train` warns)."""
    decay: Literal["linear", "cosine", "wsd"] = "linear"
    """After warmup: linear or cosine decay to the minimum, or wsd (warmup-stable-decay)."""
    decay_ratio: float = 0.2
    """wsd only: the share of the steps after warmup spent decaying (the rest stays at the peak)."""
    min_lr_factor: float = 0.1
    """The final learning rate as a fraction of optimizer.lr."""


@dataclass
class Metrics:
    log_freq: int = 5
    """Log every N steps (and the first and last step)."""
    tensorboard: bool = True
    """Write TensorBoard events under `<run folder>/tb/`."""
    wandb: bool = False
    """Also log TensorBoard's scalars to Weights & Biases, at the same steps, from rank 0 (needs the wandb
    package: pip install wandb). Its files go under `<run folder>/wandb/`, one W&B run per attempt.
    Offline (`wandb sync` uploads later) unless logged in (`wandb login`, WANDB_API_KEY); WANDB_MODE
    decides where set. docs/operations.md."""
    wandb_project: str = "titanrush"
    """The W&B project of the run (WANDB_ENTITY sets the team)."""
    wandb_name: str = ""
    """The W&B run's name; empty: job.name (a later attempt adds `-attempt-<n>`). Its attempts form a
    group named after job.name."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device for MFU. 0 looks the device up in the built-in GPU table; an unknown
    device (or CPU) then gets no MFU."""
    all_ranks: bool = False
    """Every rank writes its own metrics (rank0 only by default)."""
    verbose: bool = False
    """Every rank prints its INFO lines and every library warning (torch's, Inductor's). Off: rank 0
    prints its INFO lines and each library warning once; the other ranks only titanrush's warnings and
    errors."""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Data-parallel replicas (DDP when dp_shard is 1, HSDP when both are above 1)."""
    dp_shard: int = -1
    """FSDP2 shard degree; -1 takes whatever the other degrees leave of the world size."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel on the norms)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    cp: int = 1
    """Context-parallel degree (the sequence split over ranks; needs CUDA)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never", "auto"] = "default"
    """always = ZeRO-3, never = ZeRO-2 (keep gathered params until backward), default = always except
    the last block; auto: the planner picks never where it fits, else default ([plan],
    docs/auto_plan.md)."""
    fsdp_keep_gathered_last: int = 0
    """With fsdp_reshard_after_forward = default: the last N blocks also keep their gathered parameters
    from forward until their backward (ZeRO-2 for those blocks: no second all-gather), for N blocks'
    gathered weights (bf16 2 bytes, float8 all-gather 1 byte per parameter) more at the end of forward.
    Spends spare memory a block at a time; 0: only the last block keeps them (the default policy)."""
    fsdp_cpu_offload: bool = False
    """Keep FSDP parameters, gradients and optimizer states on the CPU."""
    nccl_max_ctas: int = 0
    """The most thread blocks (so SMs) one NCCL collective may use (NCCL_MAX_CTAS, set before the
    process group starts; one already in the environment wins); 0 = NCCL's own choice. Fewer leave more
    SMs to the matmuls that run beside FSDP's all-gathers and reduce-scatters, and make each collective
    slower."""
    sequence_parallel: bool = True
    """With tp > 1: shard the norms' activations over the sequence."""
    loss_parallel: bool = True
    """With tp > 1: compute the loss on the vocabulary-sharded logits."""
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"] = (
        "1F1B"
    )
    """Pipeline schedule from torch.distributed.pipelining."""
    pp_microbatches: int = 0
    """Micro-batches per local batch for pipelining; 0 = the number of stages."""
    pp_stages_per_rank: int = 0
    """Virtual stages per rank; 0 = 1 for single-stage schedules, 2 for interleaved ones."""
    pp_layers_per_stage: list[int] = field(default_factory=list)
    """Explicit split: layers in each stage (empty = automatic balancing)."""
    cp_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How context parallel exchanges K/V shards."""
    ep: int = 1
    """Expert-parallel degree (Llama 4 flavors): the routed experts split over this many ranks, which
    exchange tokens by all-to-all. Borrowed from dp_shard (it must divide it): each group of ep
    data-parallel ranks holds one copy of the experts, and FSDP shards the experts over the dp_shard / ep
    groups (x cp)."""


@dataclass
class MoE:
    bias_update_rate: float = 1e-2
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after each step every expert's routing bias
    moves by this much, down for experts that got more than the mean of the step's tokens, up for the
    others (the bias steers the choice of experts, never the weights); 0 turns it off. The default is 10x
    DeepSeek-V3's 1e-3, which lets the routing collapse early in training (docs/moe.md, 'Load balance')."""
    aux_loss_coeff: float = 1e-1
    """Weight of the sequence-wise load-balance loss (per sequence: experts x sum of token fraction x
    mean normalized score; 1 when balanced) in the training loss; 0 turns it off. With the bias above it
    keeps the experts balanced from the first fifty steps (docs/moe.md, 'Load balance')."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (mean squared log-sum-exp of the router logits); 0 turns it off."""
    grouped_mm: bool = True
    """The experts' matmuls as one grouped GEMM (torch.nn.functional.grouped_mm, or torch._grouped_mm on
    torch 2.9) where torch has it and the inputs fit it (CUDA: bf16); false runs one matmul per expert."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (and the loss)."""
    fullgraph: bool = True
    """Compile each block as one graph (an error if it breaks)."""
    overlap_collectives: bool = True
    """Let Inductor move the collectives inside each compiled block (tensor parallel's all-gathers and
    reduce-scatters) next to compute they can overlap, without raising the block's peak memory (the
    torch.compile options reorder_for_compute_comm_overlap and its peak-memory-preserving passes)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "auto"] = "none"
    """none, full (recompute every block), or selective (see `selective`); auto: the planner picks the
    policy that recomputes least among those that fit the GPU, with `selective`, `op_matmuls` and
    `op_all_last` ([plan], docs/auto_plan.md)."""
    selective: str = "op"
    """selective mode: `op` (keep matmul and attention outputs, recompute the rest) or an integer N
    (checkpoint every N-th block)."""
    op_matmuls: Literal["all", "alternate", "all_but_w3"] = "all"
    """selective `op`: keep every matmul output of a block (`all`), or the 1st, 3rd, 5th, ... and
    recompute the others (`alternate`: torchtitan's policy; for a Llama block about 40% fewer saved
    activations for about a third of the forward matmul work done again), or all but w3's
    (`all_but_w3`: a third fewer than `all` for a quarter of the forward matmul work; one policy, so
    one compiled block graph, where `alternate` with op_all_last compiles two)."""
    op_all_last: int = 0
    """selective `op` with op_matmuls = alternate: the last N blocks keep every matmul output anyway.
    Spends memory freed elsewhere (e.g. by training.loss = chunked) on less recomputation, a block at a
    time; `titanrush estimate` says how many fit. 0: every block alternates."""
    offload_first: int = 0
    """Activation offload over the model's first N blocks (see offload_every): an offloaded block keeps
    what it saves for backward (compiled: every matmul output; eager: everything, not checkpointed) in
    pinned host memory instead, copied out on a side stream during forward and fetched back two blocks
    ahead in backward. Trades host-link traffic for GPU memory and recomputation; needs a CUDA GPU. Takes
    precedence over the other keys for those blocks. 0: off."""
    offload_every: int = 1
    """With offload_first: offload every N-th of those blocks (0, N, 2N, ...). A block's copy out hides
    behind the compute of the N blocks after it; spread them out where one block computes faster than
    its activations cross the host link (an 8B block: about 13 ms against 30 ms on an H200)."""


@dataclass
class Float8:
    enable: bool = False
    """Train the linear layers in float8 through torchao."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Float8 scaling recipe."""
    emulate: bool = False
    """Use torchao's emulation (CPU tests, GPUs without float8)."""
    fsdp_float8_all_gather: bool = True
    """tensorwise + FSDP: all-gather weights in float8 with precomputed scales."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers (by name fragment) kept in bf16; misaligned ones (a dimension not divisible by 16)
    are kept anyway. An empty list converts the output projection too."""
    min_size: int = 1024
    """Linear layers with a dimension below this stay in bf16 (casting costs more than float8 saves);
    0 converts every aligned layer."""
    experts: bool = False
    """Llama 4: the routed experts' grouped GEMMs in float8 with rowwise scales (torchao's MoE training
    prototype; GPUs of compute capability >= 9.0). Independent of `enable`, which converts the linear
    layers (attention, shared expert, dense FFNs)."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints during training and resume from the newest complete one."""
    interval: int = 500
    """Save every N steps (and at the last step)."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to the run folder."""
    keep_latest_k: int = 0
    """Keep only the newest K complete checkpoints (0 keeps all)."""
    async_mode: Literal["disabled", "async", "async_pinned"] = "disabled"
    """Save in the background: async, or async with pinned memory staging."""
    load_path: str = ""
    """Start from this checkpoint folder instead of the run's own."""
    load_model_only: bool = False
    """With load_path: load only the model weights (a new run from pretrained weights)."""
    last_save_model_only: bool = False
    """The final save holds only the model, in export_dtype."""
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of a model-only final save."""
    save_on_signal: bool = True
    """On SIGTERM or SIGINT (preemption, Ctrl-C) finish the current step, save a checkpoint (with
    checkpoint.enable) and exit with status 128 + the signal's number. False exits without saving."""


@dataclass
class Data:
    dataset: Literal["embedded", "files", "synthetic", "shards", "hf"] = "embedded"
    """embedded (Python standard library sources), files, synthetic, shards (pre-tokenized), hf."""
    path: str = ""
    """files: a path or glob; shards: the folder `titanrush prepare` wrote; hf: the dataset name."""
    tokenizer: str = "default"
    """`default` (the shipped BPE), the path of a tiktoken rank file (e.g. Llama 3's tokenizer.model), or
    of a Hugging Face tokenizer.json or its folder (needs the `tokenizers` package)."""
    text_field: str = "text"
    """Field holding the text in .jsonl / .parquet files and hf datasets."""
    num_workers: int = 0
    """Loader worker processes (0 loads in the training process)."""
    pin_memory: bool = True
    """Pin host batches for faster copies to the GPU."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    shuffle: bool = True
    """Shuffle the train split's document order each epoch (seeded by training.seed); validation keeps
    the sorted order."""
    cache_dir: str = "~/.cache/titanrush"
    """Where the tokenized embedded / files corpora are cached, keyed by the tokenizer and the file list
    ("" = no cache; an unwritable folder only costs re-tokenizing at start-up)."""
    fingerprint: Literal["sampled", "full"] = "sampled"
    """What each checkpoint records of the train data, so that a resume on changed data stops:
    `sampled`, each file's size and a CRC-32 of its first, last and 8 evenly spaced 64 KiB blocks (about
    640 KiB read per file, however large); `full`, also a CRC-32 of every byte (each start then reads all
    the data once). The embedded corpus is recorded by its files' sizes (docs/operations.md)."""
    allow_changed: bool = False
    """Resume although the data differs from the checkpoint's fingerprint (files added, removed, resized
    or rewritten at the same path): the saved position then continues on another token stream; the
    change is named in a warning, and the next checkpoints record the data as it is now."""


@dataclass
class Validation:
    freq: int = 0
    """Validate every N steps (0 = never)."""
    steps: int = 4
    """Batches of the held-out split per validation."""


@dataclass
class Profiling:
    enable: bool = False
    """Record torch.profiler traces."""
    freq: int = 100
    """Trace one window every N steps."""
    active_steps: int = 2
    """Steps traced in each window (after one warm-up step)."""
    memory_snapshot: bool = False
    """Dump a CUDA memory snapshot after the first traced window."""
    all_ranks: bool = False
    """Trace every rank (rank 0 only by default)."""


@dataclass
class Plan:
    """How the levers set to "auto" are chosen, and the memory check before the model is built
    (docs/auto_plan.md)."""

    gpu_mem_gib: float = 0.0
    """GPU memory per GPU, GiB, that the plan is held against; 0: the CUDA device's. Without a CUDA
    device and without this key there is nothing to fit: auto levers take the least compute (no
    checkpointing, ZeRO-2, the plain loss) and the memory check is skipped."""
    margin: float = 0.05
    """The share of the GPU memory an auto plan leaves free (the estimate errs by a few percent, and
    fragmentation takes some); the memory check of an explicit plan holds it to the whole memory."""
    offload: Literal["none", "activations", "all"] = "none"
    """What the planner may add when no plan fits without it, at the cost of host-link traffic:
    activations (activation offload of the first blocks: CUDA), all (also FSDP's CPU offload of
    parameters, gradients and optimizer states: FSDP only, and much slower). none: neither."""
    memory_check: bool = True
    """Stop before the model is built when the estimated memory exceeds the GPU's (exit status 2, with
    the nearest plan that fits); false: build and run anyway."""
    probe: int = 0
    """Measure the top K plans of the auto levers (the chosen one and the next that fit) for
    probe_steps steps each on this run's GPUs and keep the fastest (written into config.toml); the run
    then starts fresh from the same seed. 0: take the cost model's choice. Nothing to probe without an
    auto lever."""
    probe_steps: int = 3
    """Steps measured per probed plan, after one warm-up step (compile, allocator)."""
    probe_seconds: float = 600.0
    """The probe's time budget: no further plan is started once it is spent (the first always runs)."""


@dataclass
class Experimental:
    """Levers that rely on private PyTorch options: off by default, refused on torch versions they were
    not run on."""

    async_tp: bool = False
    """Async tensor parallel: Inductor splits each sequence-parallel all-gather + matmul and matmul +
    reduce-scatter in a compiled block into chunks that overlap over symmetric memory (torch.compile's
    private `_micro_pipeline_tp` option, torchtitan's enable_async_tensor_parallel). Needs parallelism.tp
    > 1 with sequence_parallel, compile.enable and CUDA GPUs; run on torch 2.11."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: MoE = field(default_factory=MoE)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    plan: Plan = field(default_factory=Plan)
    experimental: Experimental = field(default_factory=Experimental)


# ----------------------------------------------------------------------------------------------
# Introspection (for the loader, the override parser and --help)


def sections() -> dict[str, type]:
    """Section name -> dataclass type."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> its type (the annotations resolved) of a section's dataclass."""
    return typing.get_type_hints(cls)
