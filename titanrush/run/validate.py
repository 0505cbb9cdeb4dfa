"""Every check of a job config, in one module: values, degrees, combinations, and what the machine needs.

`titanrush.config` checks keys and types while it parses; everything about values lives here, and
`titanrush.run.plan.build_plan` runs it all before anything is built or written. Each failure is a
`ConfigError` whose message names the key and the fix. The module imports without torch, so that
`check_values` also runs as soon as the command line is read (`titanrush.train`, the launcher): a bad value
is said in a fraction of a second, before torch's import.

- `check_values`: each key alone (ranges), and pairs of keys of the config alone; `config_warnings`: what
  is allowed but most likely not meant (a warm-up as long as the run).
- `check_degrees`: the parallel degrees against the world size.
- `check_run`: what needs the model's shape and the mesh (heads, layers, vocabulary, batch arithmetic,
  combinations of parallelisms and options).
- `check_machine`: what this machine must provide (CUDA, flash-attn, torchao, float8 tensor cores).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from titanrush.config import ConfigError, JobConfig, Model, MoE, Optimizer, Parallelism
from titanrush.models.llama import FLAVORS, ModelArgs
from titanrush.models.llama.flavors import CUSTOM
from titanrush.models.llama4 import FLAVORS as LLAMA4_FLAVORS
from titanrush.models.llama4 import Llama4Args

if TYPE_CHECKING:
    from titanrush.parallel.parallel_dims import ParallelDims

# Tokens in one micro-batch of one rank: far above any GPU's memory for a Llama (the 405B at 128k
# positions x 1,024 sequences), low enough that a typo fails here and not as a host MemoryError.
MAX_MICROBATCH_TOKENS = 2**27

# The model's shape: one weight matrix of 2^40 elements is 2 TiB in bf16, a thousand times the largest
# Llama's; the deepest Llamas have about 128 blocks. Beyond these a typo, not a model (a value in the
# quintillions would otherwise overflow torch's size arithmetic, or take hours to build on meta).
MAX_WEIGHT_ELEMENTS, MAX_LAYERS = 2**40, 2**14

# An integer setting beyond a 64-bit integer is a typo, and no count the run keeps (steps, positions,
# sizes in torch and in a checkpoint) could hold it: the bound of every integer key that has no other.
MAX_INT = 2**63 - 1

# The characters W&B refuses in a project's name.
WANDB_BAD = "/\\#?%:"

# The torch versions (major.minor) experimental.async_tp was run on, on the GPU machine.
ASYNC_TP_TORCH = ("2.11",)

# key -> (low, high, low inclusive, high inclusive): the allowed range of every numeric config key
# (None: unbounded). A test holds every int and float field of the config to having an entry here.
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "model.vocab_size": (0, None, True, True),
    # The model's dimensions: 0 keeps the flavor's or model.from_checkpoint's (see _check_model_keys).
    "model.max_seq_len": (0, None, True, True),
    "model.dim": (0, None, True, True),
    "model.n_layers": (0, None, True, True),
    "model.n_heads": (0, None, True, True),
    "model.n_kv_heads": (0, None, True, True),
    "model.ffn_hidden": (0, None, True, True),
    "model.multiple_of": (0, None, True, True),
    "model.ffn_dim_multiplier": (0.0, None, True, True),
    "model.norm_eps": (0.0, 1.0, True, False),
    "model.rope_theta": (0.0, None, True, True),
    "model.rope_scale_factor": (0.0, None, True, True),
    "model.rope_low_freq_factor": (0.0, None, True, True),
    "model.rope_high_freq_factor": (0.0, None, True, True),
    "model.rope_original_max_len": (0, None, True, True),
    "training.steps": (1, None, True, True),
    "training.local_batch_size": (1, None, True, True),
    "training.global_batch_size": (-1, None, True, True),  # -1 or > 0, see check_values
    "training.seq_len": (2, None, True, True),  # see RANGE_REASONS
    "training.max_norm": (0.0, None, True, True),
    "training.seed": (0, 2**63, True, False),
    "training.loss_chunk_size": (1, None, True, True),
    "training.gc_freq": (0, None, True, True),
    "training.max_skips": (1, None, True, True),
    "training.step_timeout": (0.0, None, True, True),  # 0: derived from the measured steps
    "job.max_restarts": (0, None, True, True),
    "job.collective_timeout": (1.0, None, True, True),  # see RANGE_REASONS
    "optimizer.lr": (0.0, None, False, True),
    "optimizer.beta1": (0.0, 1.0, True, False),
    "optimizer.beta2": (0.0, 1.0, True, False),
    "optimizer.eps": (0.0, None, False, True),
    "optimizer.weight_decay": (0.0, None, True, True),
    "lr_scheduler.warmup_steps": (0, None, True, True),
    "lr_scheduler.decay_ratio": (0.0, 1.0, True, True),
    "lr_scheduler.min_lr_factor": (0.0, 1.0, True, True),
    "metrics.log_freq": (1, None, True, True),
    "metrics.peak_tflops": (0.0, None, True, True),
    "parallelism.dp_replicate": (1, None, True, True),
    "parallelism.dp_shard": (-1, None, True, True),  # -1 or >= 1, see check_values
    "parallelism.tp": (1, None, True, True),
    "parallelism.pp": (1, None, True, True),
    "parallelism.cp": (1, None, True, True),
    "parallelism.fsdp_keep_gathered_last": (0, None, True, True),
    "parallelism.nccl_max_ctas": (0, 64, True, True),
    "parallelism.pp_microbatches": (0, None, True, True),
    "parallelism.pp_stages_per_rank": (0, None, True, True),
    "parallelism.ep": (1, None, True, True),
    "moe.bias_update_rate": (0.0, 1.0, True, False),  # see RANGE_REASONS
    "moe.aux_loss_coeff": (0.0, None, True, True),
    "moe.z_loss_coeff": (0.0, None, True, True),
    "activation_checkpoint.op_all_last": (0, None, True, True),
    "activation_checkpoint.offload_first": (0, None, True, True),
    "activation_checkpoint.offload_every": (1, None, True, True),
    "float8.min_size": (0, None, True, True),
    "checkpoint.interval": (1, None, True, True),
    "checkpoint.keep_latest_k": (0, None, True, True),
    "data.num_workers": (0, 64, True, True),  # loader processes per rank
    "data.prefetch_factor": (1, None, True, True),
    "validation.freq": (0, None, True, True),
    "validation.steps": (1, 2**63, True, False),
    "profiling.freq": (1, None, True, True),
    "profiling.active_steps": (1, None, True, True),
    "plan.gpu_mem_gib": (0.0, None, True, True),  # 0: the CUDA device's
    "plan.margin": (0.0, 0.5, True, False),
    "plan.probe": (0, None, True, True),
    "plan.probe_steps": (1, None, True, True),
    "plan.probe_seconds": (0.0, None, False, True),
}

# Why a range is what it is, where a user may not guess it (added to the refusal).
RANGE_REASONS = {
    "training.seq_len": "with one token per sequence every prediction sees that token alone, and attention "
    "has nothing to attend to",
    "job.collective_timeout": "it is also the time the processes have to connect at start-up "
    "(default 1800 s)",
    "moe.bias_update_rate": "the routing scores are sigmoids in (0, 1), so a step of 1 or more moves each "
    "expert past every other on every step (default 1e-2)",
}

# The keys that may be "auto": `titanrush.run.autoplan` resolves them before the plan is built.
AUTO_LEVERS = ("activation_checkpoint.mode", "parallelism.fsdp_reshard_after_forward", "training.loss")
# With activation_checkpoint.mode = auto the planner sets these too: they must keep their defaults.
AUTO_AC_KEYS = {"selective": "op", "op_matmuls": "all", "op_all_last": 0}


def auto_levers(cfg: JobConfig) -> list[str]:
    """The keys of `AUTO_LEVERS` that `cfg` leaves to the planner."""
    return [key for key in AUTO_LEVERS if _value(cfg, key) == "auto"]


def _value(cfg: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _range_text(low: float | None, high: float | None, low_in: bool, high_in: bool) -> str:
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


# Keys that name files or folders, and the limits of the file systems in use (Linux, macOS): a name of a
# folder or file of at most NAME_MAX bytes, a whole path of fewer than PATH_MAX.
PATH_KEYS = (
    "job.dump_folder",
    "job.name",
    "checkpoint.folder",
    "checkpoint.load_path",
    "model.from_checkpoint",
    "data.path",
    "data.tokenizer",
    "data.cache_dir",
)
NAME_MAX, PATH_MAX = 255, 4096


def path_problem(path: str) -> str:
    """Why no file system takes `path` ('' when its length is fine)."""
    size = len(os.fsencode(path))
    if size >= PATH_MAX:
        return f"a path of {size:,} bytes, past the {PATH_MAX - 1:,} a file system takes; use a shorter one"
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > NAME_MAX:
            return (
                f"the name {part[:24]!r}... has {len(os.fsencode(part))} bytes, past the {NAME_MAX} a file "
                "system takes for one folder or file name; use a shorter one"
            )
    return ""


def check_values(cfg: JobConfig) -> None:
    """Each key's range, and the rules between keys that need neither a model nor devices."""
    for key, (low, high, low_in, high_in) in RANGES.items():
        v = _value(cfg, key)
        if high is None and isinstance(v, int) and v > MAX_INT:
            high, high_in = MAX_INT, True
        ok = (low is None or (v >= low if low_in else v > low)) and (
            high is None or (v <= high if high_in else v < high)
        )
        if not ok:
            why = f": {RANGE_REASONS[key]}" if key in RANGE_REASONS else ""
            raise ConfigError(f"{key} must be {_range_text(low, high, low_in, high_in)}, got {v}{why}")
    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    name = cfg.job.name
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name:
        raise ConfigError(f"job.name = {name!r}: a folder name under job.dump_folder (no '/', not empty)")
    if not cfg.job.dump_folder.strip():
        raise ConfigError("job.dump_folder is empty: set the folder that holds run folders (e.g. ./outputs)")
    if not cfg.checkpoint.folder.strip():
        raise ConfigError("checkpoint.folder is empty: name a folder under the run folder (e.g. checkpoint)")
    for key in PATH_KEYS:
        if problem := path_problem(_value(cfg, key)):
            raise ConfigError(f"{key}: {problem}")
    if t.global_batch_size == 0 or t.global_batch_size < -1:
        raise ConfigError(f"training.global_batch_size must be -1 or > 0, got {t.global_batch_size}")
    if 0 < t.step_timeout < 1:
        raise ConfigError(
            f"training.step_timeout must be 0 (derived from the measured steps) or at least 1 second, got "
            f"{t.step_timeout}"
        )
    if p.dp_shard == 0:
        raise ConfigError("parallelism.dp_shard must be -1 (what the other degrees leave) or >= 1, got 0")
    tokens = t.local_batch_size * t.seq_len
    if tokens > MAX_MICROBATCH_TOKENS:
        raise ConfigError(
            f"training.local_batch_size x seq_len = {t.local_batch_size} x {t.seq_len} = {tokens:,} "
            f"tokens per micro-batch is beyond any GPU (at most {MAX_MICROBATCH_TOKENS:,}); lower "
            "local_batch_size and reach a large batch with training.global_batch_size (gradient accumulation)"
        )
    _check_model_keys(cfg.model)
    moe_default = MoE()  # (off or at the default: a dense model ignores the [moe] section)
    moe_set = {
        "parallelism.ep": p.ep > 1,
        "moe.aux_loss_coeff": cfg.moe.aux_loss_coeff not in (0.0, moe_default.aux_loss_coeff),
        "moe.z_loss_coeff": cfg.moe.z_loss_coeff not in (0.0, moe_default.z_loss_coeff),
        "moe.bias_update_rate": cfg.moe.bias_update_rate not in (0.0, moe_default.bias_update_rate),
    }
    key = next((k for k, on in moe_set.items() if on), None)
    if key and cfg.model.flavor not in LLAMA4_FLAVORS:
        raise ConfigError(
            f"{key} applies to mixture-of-experts models: the {cfg.model.flavor} flavor has no experts; "
            f"choose a Llama 4 flavor ({', '.join(LLAMA4_FLAVORS)}) or leave {key} at its default"
        )
    if cfg.profiling.freq < cfg.profiling.active_steps + 2:
        raise ConfigError(
            f"profiling.freq ({cfg.profiling.freq}) must be >= profiling.active_steps + 2 (a wait step and a "
            "warm-up step before the traced ones)"
        )
    sel = ac.selective
    if sel != "op" and not (sel.isascii() and sel.isdigit() and int(sel) > 0):
        raise ConfigError(
            f"activation_checkpoint.selective = {sel!r}: use 'op' or a positive integer N (every N-th block)"
        )
    if ac.mode == "auto":
        for key, default in AUTO_AC_KEYS.items():
            if getattr(ac, key) != default:
                raise ConfigError(
                    f"activation_checkpoint.{key} = {getattr(ac, key)!r} is the planner's choice with "
                    f"mode = 'auto': remove it (or set mode to none, full or selective)"
                )
    keep = p.fsdp_keep_gathered_last
    if keep and p.fsdp_reshard_after_forward not in ("default", "auto"):
        raise ConfigError(
            f"parallelism.fsdp_keep_gathered_last = {keep} only applies to fsdp_reshard_after_forward = "
            f"default (not {p.fsdp_reshard_after_forward!r}): remove one of them"
        )
    if ac.op_all_last and not (ac.mode == "selective" and sel == "op" and ac.op_matmuls == "alternate"):
        raise ConfigError(
            f"activation_checkpoint.op_all_last = {ac.op_all_last} only applies to selective op "
            "checkpointing with op_matmuls = alternate: set mode = 'selective', selective = 'op', "
            "op_matmuls = 'alternate', or op_all_last = 0"
        )
    if cfg.optimizer.name != "adamw" and cfg.optimizer.implementation != Optimizer.implementation:
        raise ConfigError(
            f"optimizer.implementation = {cfg.optimizer.implementation!r} chooses torch's AdamW kernel; "
            f"optimizer.name = {cfg.optimizer.name!r} steps with torchao's own: remove one of them"
        )
    if p.pp > 1 and p.pp_schedule in ("GPipe", "1F1B") and p.pp_stages_per_rank > 1:
        raise ConfigError(
            f"parallelism.pp_schedule = {p.pp_schedule} runs one stage per rank; set pp_stages_per_rank = 1 "
            "or choose Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble"
        )
    if p.pp > 1 and p.pp_schedule == "ZBVZeroBubble" and p.pp_stages_per_rank not in (0, 2):
        raise ConfigError("parallelism.pp_schedule = ZBVZeroBubble places exactly 2 stages per rank (a V)")
    if p.pp > 1 and p.pp_schedule == "ZBVZeroBubble" and cfg.validation.freq:
        raise ConfigError(
            "validation.freq > 0 with parallelism.pp_schedule = ZBVZeroBubble: torch's forward-only pass of "
            "that schedule fails (Schedule.eval); set validation.freq = 0 or choose another schedule"
        )
    if cfg.float8.enable and t.precision != "bf16":
        raise ConfigError("float8.enable needs training.precision = 'bf16'")
    if cfg.checkpoint.load_model_only and not cfg.checkpoint.load_path:
        raise ConfigError(
            "checkpoint.load_model_only applies to checkpoint.load_path: set the checkpoint to start from"
        )
    project = cfg.metrics.wandb_project
    if cfg.metrics.wandb and (not project.strip() or len(project) > 128 or set(project) & set(WANDB_BAD)):
        raise ConfigError(
            f"metrics.wandb_project = {project!r}: a W&B project name has 1 to 128 characters, none of "
            f"{' '.join(WANDB_BAD)}"
        )


def config_warnings(cfg: JobConfig) -> list[str]:
    """What a config may say but most likely does not mean, a line each: warnings, not errors (the run goes
    on). `titanrush train` prints them once the config is accepted (`--check`: before `config OK`; a run:
    rank 0, once the trainer is built), so that an error stays one line."""
    warmup, steps = cfg.lr_scheduler.warmup_steps, cfg.training.steps
    if warmup < steps:
        return []
    peak = (
        "reaches optimizer.lr only at the last step"
        if warmup == steps
        else f"never reaches optimizer.lr (it ends at {steps / warmup:.0%} of it)"
    )
    return [
        f"lr_scheduler.warmup_steps = {warmup} is not below training.steps = {steps}: the learning rate "
        f"{peak} and never decays; set lr_scheduler.warmup_steps below training.steps "
        f"(e.g. {max(steps // 10, 1) if steps > 1 else 0})"
    ]


# [model] keys that change the architecture: only a custom shape takes them (a named flavor stays what its
# name says); model.vocab_size, tie_embeddings and max_seq_len adapt any flavor.
ARCHITECTURE_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "multiple_of",
    "ffn_dim_multiplier",
    "norm_eps",
    "rope_theta",
    "rope_scale_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
)
_LLAMA3_ROPE_KEYS = ARCHITECTURE_KEYS[-4:]


def _check_model_keys(m: Model) -> None:
    """The flavor's name, and which shape keys it takes (see ARCHITECTURE_KEYS)."""
    if m.flavor not in FLAVORS and m.flavor not in LLAMA4_FLAVORS and m.flavor != CUSTOM:
        names = [*FLAVORS, *LLAMA4_FLAVORS, CUSTOM]
        lower = {f.lower(): f for f in names}
        near = [lower[m.flavor.lower()]] if m.flavor.lower() in lower else []
        near = near or difflib.get_close_matches(m.flavor, names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"model.flavor = {m.flavor!r} is not one of {', '.join(names)}{hint}")
    given = [k for k in ARCHITECTURE_KEYS if getattr(m, k)] + ["rope_scaling"] * (m.rope_scaling != "flavor")
    if m.flavor != CUSTOM:
        if m.from_checkpoint:
            raise ConfigError(
                f"model.from_checkpoint takes the model's shape from {m.from_checkpoint!r}: set "
                f"model.flavor = 'custom' (not {m.flavor!r}), or remove model.from_checkpoint"
            )
        if given:
            raise ConfigError(
                f"model.{given[0]} applies to model.flavor = 'custom' (this run uses {m.flavor!r}, whose "
                f"shape is fixed): set model.flavor = 'custom' with the model's dimensions, or remove "
                f"model.{given[0]}"
            )
        return
    if not m.from_checkpoint:
        missing = [k for k in ("dim", "n_layers", "n_heads", "vocab_size") if not getattr(m, k)]
        if missing:
            raise ConfigError(
                "model.flavor = 'custom' takes its shape from model.from_checkpoint (a checkpoint or Hugging "
                f"Face folder) or from the [model] keys; set model.{', model.'.join(missing)}"
            )
    if m.ffn_hidden and (m.multiple_of or m.ffn_dim_multiplier):
        raise ConfigError(
            "model.ffn_hidden sets the SwiGLU width exactly; remove model.multiple_of and "
            "model.ffn_dim_multiplier (they derive it), or remove model.ffn_hidden"
        )
    scale_keys = [k for k in _LLAMA3_ROPE_KEYS if getattr(m, k)]
    if m.rope_scaling == "none" and scale_keys:
        raise ConfigError(
            f"model.{scale_keys[0]} applies to model.rope_scaling = 'llama3', not 'none': remove one of them"
        )


def check_model_args(args: ModelArgs) -> None:
    """The resolved shape can be built: heads divide the width, K/V heads the heads, RoPE's pairs fit, the
    norm's epsilon and RoPE's base are usable numbers."""
    matrices = {
        "model.vocab_size x dim": args.vocab_size * args.dim,
        "model.dim x dim": args.dim * args.dim,
        "the feed-forward size x model.dim": args.ffn_hidden * args.dim,
    }
    for what, size in matrices.items():
        if size > MAX_WEIGHT_ELEMENTS:
            raise ConfigError(
                f"a weight of {what} = {size:,} elements is beyond any machine (at most "
                f"{MAX_WEIGHT_ELEMENTS:,}); check the model's dimensions"
            )
    if args.n_layers > MAX_LAYERS:
        raise ConfigError(f"model.n_layers = {args.n_layers:,} is beyond any model (at most {MAX_LAYERS:,})")
    if args.dim % args.n_heads:
        raise ConfigError(
            f"model.dim ({args.dim}) must be divisible by model.n_heads ({args.n_heads}): the heads split it"
        )
    if args.n_heads % args.kv_heads:
        raise ConfigError(
            f"model.n_heads ({args.n_heads}) must be a multiple of model.n_kv_heads ({args.kv_heads}): "
            "each K/V head serves a group of query heads"
        )
    if args.head_dim % 2:
        raise ConfigError(
            f"the head dimension model.dim / model.n_heads = {args.head_dim} must be even (RoPE rotates "
            "pairs)"
        )
    if not 0 < args.norm_eps < 1:  # (NaN fails too: a model.from_checkpoint's config may hold anything)
        raise ConfigError(f"the model's norm_eps must be in (0, 1), got {args.norm_eps} (model.norm_eps)")
    if not 0 < args.rope_theta < math.inf:
        raise ConfigError(f"the model's rope_theta must be a finite number > 0, got {args.rope_theta}")
    if args.rope_scaling and not (
        args.rope_scale_factor > 0
        and 0 < args.rope_low_freq_factor <= args.rope_high_freq_factor
        and args.rope_original_max_len > 0
    ):
        raise ConfigError(
            f"llama3 RoPE scaling needs model.rope_scale_factor > 0 ({args.rope_scale_factor}), 0 < "
            f"rope_low_freq_factor ({args.rope_low_freq_factor}) <= rope_high_freq_factor "
            f"({args.rope_high_freq_factor}) and rope_original_max_len > 0 ({args.rope_original_max_len})"
        )


# How a user sets the number of processes, for a refusal about the world size.
_WORLD_HINT = "NGPU={n} ./run_train.sh ...; titanrush estimate --ngpu {n}"


def check_degrees(p: Parallelism, world_size: int) -> None:
    """The degrees multiply to the world size (`dp_shard = -1` taking what the others leave)."""
    others = p.dp_replicate * p.cp * p.tp * p.pp
    if p.dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"parallelism degrees dp_replicate x cp x tp x pp = {others} do not divide the world size "
                f"{world_size}; choose degrees whose product divides {world_size}, or run on a multiple "
                f"of {others} processes ({_WORLD_HINT.format(n=others)})"
            )
        return
    if others * p.dp_shard != world_size:
        raise ConfigError(
            f"dp_replicate({p.dp_replicate}) x dp_shard({p.dp_shard}) x cp({p.cp}) x tp({p.tp}) x pp({p.pp}) "
            f"= {others * p.dp_shard}, but the world size is {world_size}; set parallelism.dp_shard = -1 to "
            f"take what is left, change the degrees, or run on {others * p.dp_shard} processes "
            f"({_WORLD_HINT.format(n=others * p.dp_shard)})"
        )


def check_run(cfg: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    """What needs the model's shape and the mesh: fit, batch arithmetic and combinations."""
    t, p, m = cfg.training, cfg.parallelism, cfg.model
    check_model_args(args)
    words = tokenizer_words(cfg.data.tokenizer)
    if args.vocab_size < words:
        # (a vocabulary the weights to load fix: a larger one would not load them)
        source = (m.from_checkpoint if not m.vocab_size else "") or cfg.checkpoint.load_path
        n = args.vocab_size
        fix = (
            f"the weights of {source} have that vocabulary: use a tokenizer of at most {n} ids (the model's "
            f"own, or `titanrush tokenizer --vocab-size {n} --output DIR`, then data.tokenizer = DIR)"
            if source
            else f"set model.vocab_size >= {words} or use a tokenizer that fits"
        )
        raise ConfigError(
            f"model vocabulary ({args.vocab_size}) does not cover the tokenizer's {words} tokens; {fix}"
        )
    if t.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {t.seq_len} exceeds the {m.flavor} model's maximum of {args.max_seq_len}"
        )
    _check_mesh_fits(dims, args, t.seq_len)
    ac = cfg.activation_checkpoint
    every = int(ac.selective) if ac.mode == "selective" and ac.selective != "op" else 0
    for key, count, low in (
        ("activation_checkpoint.op_all_last", ac.op_all_last, 0),
        ("activation_checkpoint.offload_first", ac.offload_first, 0),
        ("activation_checkpoint.selective", every, 1),
        ("parallelism.fsdp_keep_gathered_last", p.fsdp_keep_gathered_last, 0),
    ):
        if count > args.n_layers:
            raise ConfigError(
                f"{key} = {count}: the {m.flavor} model has {args.n_layers} blocks; "
                f"use {low}..{args.n_layers}"
            )
    per_step = t.local_batch_size * dims.dp
    gbs = per_step if t.global_batch_size == -1 else t.global_batch_size
    if gbs % per_step:
        raise ConfigError(
            f"training.global_batch_size = {gbs} must be a multiple of local_batch_size x dp = "
            f"{t.local_batch_size} x {dims.dp} = {per_step}"
        )
    # Context parallel composes with every other degree (pp included: the pipeline's step runs inside
    # it); its ring attention replaces SDPA, so the other attention kernels would attend within each
    # rank's shard of the sequence only.
    if dims.cp > 1 and m.attn_backend not in ("sdpa", "cudnn"):
        raise ConfigError(
            f"parallelism.cp > 1 needs model.attn_backend = 'sdpa' or 'cudnn' (context parallel's ring "
            f"attention replaces SDPA), not {m.attn_backend!r}"
        )
    if dims.pp > 1:
        _check_pipeline(cfg, dims, args)
    if isinstance(args, Llama4Args):
        _check_moe(cfg, dims, args)
    elif cfg.float8.experts:
        raise ConfigError(
            f"float8.experts needs a Llama 4 (mixture-of-experts) flavor; {cfg.model.flavor!r} has no "
            "experts: set float8.experts = false (float8.enable converts the linear layers)"
        )
    if dims.tp > 1 and args.loss_chunk_size > 0:
        raise ConfigError(
            "training.loss = chunked does not compose with parallelism.tp > 1; use training.loss = plain "
            "(with parallelism.loss_parallel the logits are already sharded over the vocabulary)"
        )
    if dims.ddp_enabled and dims.tp > 1:
        raise ConfigError(
            "DDP (dp_replicate > 1 with dp_shard = 1) does not compose with tensor parallel; set "
            "parallelism.dp_shard > 1 (FSDP, or HSDP with dp_replicate) together with tp"
        )
    if p.fsdp_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError("parallelism.fsdp_cpu_offload needs FSDP: parallelism.dp_shard > 1")
    if cfg.experimental.async_tp:
        _check_async_tp(cfg, dims)


def tokenizer_words(spec: str) -> int:
    """The ids of the tokenizer `data.tokenizer` names (read once per file version: the planner builds
    hundreds of plans of one config)."""
    from titanrush.data.tokenizer import tokenizer_path  # (a missing file: build_tokenizer's ConfigError)

    try:
        path = tokenizer_path(spec)
        version = (str(path.resolve()), path.stat().st_mtime_ns, path.stat().st_size)
    except (OSError, ConfigError):
        version = None
    return _tokenizer_words(spec, version) if version else _tokenizer_words.__wrapped__(spec, None)


@functools.lru_cache(maxsize=16)
def _tokenizer_words(spec: str, version: tuple[str, int, int] | None) -> int:
    from titanrush.data import build_tokenizer  # (reads the tokenizer file: a missing one is a ConfigError)

    return build_tokenizer(spec).n_words


def _check_async_tp(cfg: JobConfig, dims: ParallelDims) -> None:
    """Async TP fuses the sequence-parallel collectives with the matmuls of the compiled blocks."""
    missing = [
        what
        for what, ok in (
            ("parallelism.tp > 1", dims.tp > 1),
            ("parallelism.sequence_parallel = true", cfg.parallelism.sequence_parallel),
            ("compile.enable = true", cfg.compile.enable),
        )
        if not ok
    ]
    if missing:
        raise ConfigError(
            f"experimental.async_tp needs {' and '.join(missing)} (it fuses tensor parallel's "
            "sequence-parallel all-gathers and reduce-scatters with the matmuls Inductor compiles); set "
            "those, or experimental.async_tp = false"
        )


def _check_mesh_fits(dims: ParallelDims, args: ModelArgs, seq_len: int) -> None:
    n_heads, n_kv = args.n_heads, args.kv_heads
    if n_heads % dims.tp or n_kv % dims.tp:
        g = math.gcd(n_heads, n_kv)
        choices = ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)
        raise ConfigError(
            f"parallelism.tp = {dims.tp} must divide the attention heads ({n_heads}) and KV heads ({n_kv}); "
            f"choose tp among {choices}"
        )
    if dims.pp > args.n_layers:
        raise ConfigError(f"parallelism.pp = {dims.pp} exceeds the model's {args.n_layers} layers")
    if dims.cp > 1:
        need = 2 * dims.cp * max(dims.tp, 1)
        if seq_len % need:
            raise ConfigError(
                f"training.seq_len = {seq_len} must be divisible by 2 x cp{' x tp' if dims.tp > 1 else ''} = "
                f"{need} (context parallel's load balancing splits each sequence into 2 x cp chunks)"
            )
    if dims.tp > 1 and seq_len % dims.tp:
        raise ConfigError(
            f"training.seq_len = {seq_len} must be divisible by tp = {dims.tp} (sequence parallel)"
        )


def _check_pipeline(cfg: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    p = cfg.parallelism
    if args.tie_embeddings:
        raise ConfigError(
            "parallelism.pp > 1 cannot tie the embedding (first stage) to the output projection (last "
            "stage); set model.tie_embeddings = 'untied'"
        )
    if args.loss_chunk_size > 0:
        raise ConfigError("training.loss = chunked does not compose with parallelism.pp > 1; use 'plain'")
    per_rank = 1 if p.pp_schedule in ("GPipe", "1F1B") else (p.pp_stages_per_rank or 2)
    n_stages = dims.pp * per_rank
    if args.n_layers < n_stages:
        raise ConfigError(
            f"{n_stages} pipeline stages (pp x stages per rank) need at least {n_stages} layers, the model "
            f"has {args.n_layers}"
        )
    microbatches = p.pp_microbatches or n_stages
    if cfg.training.local_batch_size % microbatches:
        raise ConfigError(
            f"training.local_batch_size = {cfg.training.local_batch_size} must be divisible by the "
            f"pipeline's {microbatches} micro-batches (parallelism.pp_microbatches, default pp x stages "
            "per rank)"
        )
    if microbatches < dims.pp:
        raise ConfigError(f"parallelism.pp_microbatches = {microbatches} must be >= pp = {dims.pp}")
    split = p.pp_layers_per_stage
    if split and (len(split) != n_stages or sum(split) != args.n_layers or min(split) < 1):
        raise ConfigError(
            f"parallelism.pp_layers_per_stage = {split} must list {n_stages} positive counts "
            f"(pp x stages per rank) that add up to the model's {args.n_layers} layers"
        )


def flash_installed() -> bool:
    """Whether a flash-attn package is installed (found, not imported: FA4's import takes seconds)."""
    return any(_found(m) for m in ("flash_attn", "flash_attn_interface"))


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without an import spec (a module made in-process)
        return module in sys.modules


def _check_moe(cfg: JobConfig, dims: ParallelDims, args: Llama4Args) -> None:
    """Expert parallel against the mesh and the experts; Llama 4's attention options against the run."""
    m, seq = cfg.model, cfg.training.seq_len
    if dims.ep > dims.world_size:
        raise ConfigError(
            f"parallelism.ep = {dims.ep} needs at least {dims.ep} processes, one per expert shard (this run "
            f"has {dims.world_size}): launch with NGPU={dims.ep} ./run_train.sh, or leave parallelism.ep at 1"
        )
    if dims.ep > 1 and dims.dp_shard % dims.ep:
        raise ConfigError(
            f"parallelism.ep = {dims.ep} must divide dp_shard = {dims.dp_shard} (expert parallel borrows its "
            "ranks from dp_shard); choose ep among the divisors of dp_shard"
        )
    if args.n_experts % dims.ep:
        raise ConfigError(
            f"parallelism.ep = {dims.ep} must divide the {m.flavor} model's {args.n_experts} experts"
        )
    if dims.tp > 1 and dims.cp > 1:
        raise ConfigError(
            f"parallelism.cp = {dims.cp} does not compose with parallelism.tp = {dims.tp} on "
            f"mixture-of-experts layers yet ({m.flavor}: untested on GPUs); set one of them to 1 (shard "
            "with dp_shard and parallelism.ep instead of tp)"
        )
    f8 = cfg.float8
    if f8.experts and (cfg.training.precision != "bf16" or f8.emulate):
        why = "float8.emulate = true" if f8.emulate else f"training.precision = {cfg.training.precision!r}"
        raise ConfigError(
            f"float8.experts runs on bf16 training (training.precision = 'bf16'), without float8.emulate; "
            f"this run has {why}: change it, or set float8.experts = false"
        )
    chunk = args.attn_chunk
    if chunk and seq > chunk:
        if seq % chunk:
            raise ConfigError(
                f"training.seq_len = {seq} must be a multiple of the {m.flavor} model's attention chunk "
                f"({chunk} tokens), or at most one chunk"
            )
        if m.attn_backend == "flex":
            raise ConfigError(
                "model.attn_backend = 'flex' does not take Llama 4's chunked attention; use 'sdpa'"
            )
        if dims.cp > 1:
            raise ConfigError(
                f"parallelism.cp > 1 does not compose with chunked attention: training.seq_len = {seq} "
                f"must be at most the attention chunk ({chunk})"
            )


def import_problem(module: str) -> str:
    """Why `module` cannot be imported ('' where it can): not installed, or its import fails (a broken
    install). Imports it: only for a module the run will import anyway."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == module:
            return "not installed"
        text = str(e).strip().splitlines()
        return f"its import fails: {type(e).__name__}: {text[0][:200] if text else ''}"
    return ""


def _has_moe_training() -> bool:
    """Whether torchao has the float8 grouped GEMM of its MoE training prototype (importing it is slow:
    only asked for when float8.experts is on)."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except ImportError:
        return False
    return True


def check_machine(cfg: JobConfig) -> None:
    """What this machine must provide for the config: CUDA, flash-attn, torchao, float8 tensor cores."""
    import torch  # (the only check of this module that needs it: the others run before torch's import)

    cuda = torch.cuda.is_available()
    backend = cfg.model.attn_backend
    if cfg.parallelism.cp > 1 and not cuda:
        raise ConfigError("parallelism.cp > 1 needs CUDA GPUs (ring attention runs on SDPA's GPU kernels)")
    if backend == "flash" and not flash_installed():
        raise ConfigError(
            "model.attn_backend = 'flash' needs the flash-attn package (pip install flash-attn, or the "
            "flash-attn-4 / FA3 hopper build); use attn_backend = 'sdpa' or 'cudnn' without it"
        )
    if backend in ("flex", "cudnn") and not cuda:
        why = (
            "FlexAttention has no backward on CPU" if backend == "flex" else "cuDNN attention is a GPU kernel"
        )
        raise ConfigError(
            f"model.attn_backend = {backend!r} needs a CUDA GPU for training ({why}); use 'sdpa'"
        )
    if cfg.activation_checkpoint.offload_first and not cuda:
        raise ConfigError(
            "activation_checkpoint.offload_first needs a CUDA GPU (it moves activations to host memory); "
            "set it to 0 here"
        )
    if cfg.float8.enable:
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError(
                "float8.enable needs torchao (pip install torchao); or set float8.enable = false"
            )
        if not cfg.float8.emulate and not (cuda and torch.cuda.get_device_capability() >= (8, 9)):
            where = "on CPU" if not cuda else f"on {torch.cuda.get_device_name()}"
            raise ConfigError(
                f"float8 training needs a GPU with float8 tensor cores (compute capability >= 8.9), not "
                f"{where}; set float8.emulate = true to emulate it (slow, for tests) or float8.enable = false"
            )
    if cfg.float8.experts:
        if importlib.util.find_spec("torchao") is None or not _has_moe_training():
            raise ConfigError(
                "float8.experts needs torchao with its MoE training prototype (torchao.prototype."
                "moe_training, torchao >= 0.17); install it or set float8.experts = false"
            )
        if not (cuda and torch.cuda.get_device_capability() >= (9, 0)):
            where = "on CPU" if not cuda else f"on {torch.cuda.get_device_name()}"
            raise ConfigError(
                f"float8.experts needs a GPU with float8 grouped GEMMs (compute capability >= 9.0: "
                f"Hopper or later), not {where}; set float8.experts = false"
            )
    if cfg.experimental.async_tp:
        if not cuda:
            raise ConfigError(
                "experimental.async_tp needs CUDA GPUs (symmetric memory over NVLink); set it to false"
            )
        version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
        if version not in ASYNC_TP_TORCH:
            raise ConfigError(
                f"experimental.async_tp relies on a private torch.compile option and was run on torch "
                f"{', '.join(ASYNC_TP_TORCH)} only, not {torch.__version__}; set it to false"
            )
    if cfg.metrics.wandb and (why := import_problem("wandb")):
        raise ConfigError(
            f"metrics.wandb = true needs the wandb package ({why}): pip install wandb (or pip install -e "
            "'.[wandb]' in the checkout); or set metrics.wandb = false"
        )
    if cfg.optimizer.name != "adamw" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"optimizer.name = {cfg.optimizer.name!r} needs torchao (pip install torchao); or use 'adamw'"
        )
