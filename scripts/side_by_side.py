"""titanrush against torchtitan 0.2.2 on identical settings, in one GPU run, with the ratio table.

Usage (on the GPU machine, from the repo root; torchtitan importable, e.g. from wheels in .whl/):
  python scripts/side_by_side.py --out DIR [--rows 1b_eager,1b_compile,...] [--steps 40] [--measure-from 20]
      [--gpus 0,1] [--variants same,ac_alternate] [--profile STEP] [--timeout-per-run 300] [--dry-run]

Rows (the reference table of docs/benchmarks/performance.md): the 1B (Llama 3.2 shape, untied output)
on one GPU at seq 2048, local batch 8 (16 for `1b_compile_b16`), no activation checkpointing; the 8B
with FSDP over 4 GPUs at seq 8192, local batch 2, selective per-op AC. Both trainers use fused AdamW,
bf16 mixed precision, gradient clipping at 1.0, the same corpus (the Python standard library sources
that titanrush embeds) and the same tokenizer (titanrush's BPE, converted for torchtitan's Hugging Face
loader). Besides `same` (the same settings), a row may have titanrush variants (`--variants`), run
and named `<row>+<variant>`: torchtitan's AC policy, titanrush's lean loss spent on fewer recomputed
matmuls, and best-settings candidates (no AC, ZeRO-2); see `_8B_VARIANTS` and `_1B_VARIANTS`.
`--profile STEP` has both trainers trace that step and summarizes rank 0's traces (trace_summary.py).

The figures: tokens/s per GPU as each trainer logs it, averaged over the steps from --measure-from on
(both log every step); peak memory = the largest reserved (`torch.cuda.max_memory_reserved`) over those
steps; time to first step = wall time from launching the command to the first step's log line
(process start, model build, compile included). On a machine with several GPUs and 1-GPU rows, `--gpus
0,1` runs torchtitan on the first GPU and titanrush on the second at the same time (each row twice,
swapping the GPUs, averaging), so both see the same machine state.

Writes DIR/results.jsonl, DIR/results.md and every run's log; prints the table last.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_runs import environment  # noqa: E402

from titanrush.tools.rush_runner import child_env, detect_oom, kill_group, read_metrics, speedup  # noqa: E402


@dataclass
class Row:
    """One reference row: the settings both trainers run with."""

    name: str
    ngpu: int
    flavor: str
    seq_len: int
    batch: int
    compile: bool
    float8: bool = False
    ac: str = "none"  # none | op
    titanrush_variants: dict[str, list[str]] = field(default_factory=dict)


# (first, every, last): every E-th of the first F blocks offloaded, the last M keeping every matmul output
_OFFLOAD_VARIANTS = (
    (12, 1, 17), (24, 3, 11), (24, 3, 13), (24, 3, 14), (24, 2, 17), (24, 2, 20), (30, 2, 32),
)  # fmt: skip
# ... with the chunked loss (gradients in forward, no full logits), whose freed memory keeps more blocks'
_CHUNKED_OFFLOAD_VARIANTS = (*((24, 3, m) for m in range(16, 26)), (24, 6, 10), (24, 6, 12))  # matmul outputs


_AC = "--activation_checkpoint."


def _last_flags(last: int) -> list[str]:
    """torchtitan's alternate policy, the last `last` blocks keeping every matmul output."""
    return [_AC + "op_matmuls", "alternate", _AC + "op_all_last", str(last)]


def _offload_flags(first: int, every: int, last: int) -> list[str]:
    return [*_last_flags(last), _AC + "offload_first", str(first), _AC + "offload_every", str(every)]


# The memory-tuned variants measured before change 21 keep FSDP's own gradient allocation, so that they
# reproduce their recorded figures; the `_pool` ones take the default (the compute stream's pool).
_OWN = ["--parallelism.fsdp_grads_in_compute_pool", "false"]


# The best-settings candidate: no AC, ZeRO-2 (gathered weights kept until backward), flash-attn-4 between
# the block's compiled graphs.
_ZERO2 = ["--activation_checkpoint.mode", "none", "--parallelism.fsdp_reshard_after_forward", "never"]
_BEST = [*_ZERO2, "--model.attn_backend", "flash", "--no-model.flash_in_graph"]


def _w3_keep(k: int) -> list[str]:
    """One selective policy (all matmul outputs but w3's), the last k blocks keeping gathered weights."""
    return [
        *("--training.loss", "chunked", "--activation_checkpoint.op_matmuls", "all_but_w3"),
        *("--model.attn_backend", "flash", "--parallelism.fsdp_keep_gathered_last", str(k)),
    ]


_8B_VARIANTS = {
    # torchtitan's per-op policy keeps every other matmul output; ours keeps all by default.
    "ac_alternate": ["--activation_checkpoint.op_matmuls", "alternate"],
    # Best-settings candidates (same model, GPUs and global batch): the estimator's picks that fit.
    "ac_none": ["--activation_checkpoint.mode", "none"],
    # The lean loss's freed memory spent on keeping matmul outputs (eager: torchtitan's fp32 logits).
    "chunked_all": ["--training.loss", "chunked"],
    "chunked_last24": [
        *("--training.loss", "chunked", "--activation_checkpoint.op_matmuls", "alternate"),
        *("--activation_checkpoint.op_all_last", "24"),
    ],
    "chunked_last30": [
        *("--training.loss", "chunked", "--activation_checkpoint.op_matmuls", "alternate"),
        *("--activation_checkpoint.op_all_last", "30"),
    ],
    "chunked1k_last4": [
        *("--training.loss", "chunked", "--training.loss_chunk_size", "1024"),
        *("--activation_checkpoint.op_matmuls", "alternate", "--activation_checkpoint.op_all_last", "4"),
    ],
    "ac_none_zero2": _ZERO2,
    # ... with flash-attn's kernels (the package installed beside torch) instead of cuDNN's
    "ac_none_zero2_flash": [*_ZERO2, "--model.attn_backend", "flash"],
    # ... with flash-attn-4 called between the block's compiled graphs (its own autograd function)
    "ac_none_zero2_flash_between": _BEST,
    # ... with each NCCL collective on at most N thread blocks (more SMs for the matmuls beside them)
    **{
        f"ac_none_zero2_flash_between_ctas{n}": [*_BEST, "--parallelism.nccl_max_ctas", str(n)]
        for n in (4, 8, 16)
    },
    # ... with the optimizer step unit by unit beside the next forward (change 29)
    "ac_none_zero2_flash_between_overlap": [*_BEST, "--optimizer.overlap_step"],
    "ac_none_zero2_flash_overlap": [*_ZERO2, "--model.attn_backend", "flash", "--optimizer.overlap_step"],
    # ... with FSDP's own reduce-scatter copy-in (chunk_cat; titanrush copies chunk by chunk since change 25)
    "ac_none_zero2_flash_between_chunkcat": [*_BEST, "--no-parallelism.fsdp_copy_in_by_chunks"],
    # One selective policy for every block (one compiled block graph): all matmul outputs but w3's, the
    # memory it saves spent on the last K blocks keeping their gathered weights (change 26)
    **{f"w3_keep{k}_pool_flash": _w3_keep(k) for k in (0, 16, 20, 24)},
    "w3_keep24_pool_flash_overlap": [*_w3_keep(24), "--optimizer.overlap_step"],
    # Activation offload: every E-th of the first F blocks keeps every matmul output in host memory,
    # which pays for the last M blocks keeping every matmul output too (alternate elsewhere).
    **{f"off{f}e{e}_last{m}": [*_offload_flags(f, e, m), *_OWN] for f, e, m in _OFFLOAD_VARIANTS},
    **{
        f"c_off{f}e{e}_last{m}": ["--training.loss", "chunked", *_offload_flags(f, e, m), *_OWN]
        for f, e, m in _CHUNKED_OFFLOAD_VARIANTS
    },
    # ... without offload: the chunked loss's memory alone paying for the last M blocks
    **{f"c_last{m}": ["--training.loss", "chunked", *_last_flags(m), *_OWN] for m in range(4, 15)},
    # ... with the sharded gradients in the compute stream's pool (change 21): reserved memory for more;
    # and with 2,048-token loss chunks (0.98 GiB off the chunk loop, the peak) and/or flash-attn-4
    **{
        f"{c}_last{m}_pool{fl}": [
            *("--training.loss", "chunked", *_last_flags(m), "--parallelism.fsdp_grads_in_compute_pool"),
            *(["--training.loss_chunk_size", "2048"] if c == "c2k" else []),
            *(["--model.attn_backend", "flash"] if fl else []),
        ]
        for c, m, fl in (
            *(("c", m, "") for m in (6, 10, 12, 14, 16, 18, 20, 22)),
            *(("c2k", 18, ""), ("c", 12, "_flash"), ("c", 14, "_flash"), ("c2k", 16, "_flash")),
            *(("c", 16, "_flash"), ("c", 18, "_flash")),
        )
    },
    # ... with inductor's own compile workers (up to 32 per rank, started at the first compile), as before
    # change 23 gave each rank its share of the cores, started at launch: what that change buys
    "c_last16_pool_inductor_workers": [
        *("--training.loss", "chunked", *_last_flags(16), "--compile.workers", "-1"),
    ],
    # ... with FSDP's own timing for releasing the reduce-scatter inputs (before change 17)
    "c_last6_late": [
        "--training.loss",
        "chunked",
        *_last_flags(6),
        "--parallelism.fsdp_free_reduce_inputs",
        "false",
        *_OWN,
    ],
    # ... with the loss in 2,048-token chunks (half the chunk's logits and their gradient at its peak)
    "c2k_off24e3_last21": [
        *("--training.loss", "chunked", "--training.loss_chunk_size", "2048", *_offload_flags(24, 3, 21)),
        *_OWN,
    ],
    # ... with FSDP's own timing for releasing the reduce-scatter inputs (before change 17)
    "c_off24e3_last21_late": [
        *("--training.loss", "chunked", *_offload_flags(24, 3, 21)),
        *("--parallelism.fsdp_free_reduce_inputs", "false", *_OWN),
    ],
    # offload's first-step pinning by cudaHostAlloc, not malloc + register by 8 threads (before change 18)
    "c_off24e3_last21_pin0": [
        *("--training.loss", "chunked", *_offload_flags(24, 3, 21)),
        *("--activation_checkpoint.offload_pin_threads", "0", *_OWN),
    ],
    # The chunked loss alone at torchtitan's policy: what the loss itself costs or saves.
    "chunked_alternate": ["--training.loss", "chunked", "--activation_checkpoint.op_matmuls", "alternate"],
    # ... and with float8 for the output projection too (torchtitan keeps it in bf16)
    "f8out_none_zero2": [
        *("--activation_checkpoint.mode", "none"),
        *("--parallelism.fsdp_reshard_after_forward", "never", "--float8.filter_fqns", ""),
    ],
}
_1B_VARIANTS = {"chunked": ["--training.loss", "chunked"]}  # no fp32 logits in eager either
VARIANTS = ("same", *_1B_VARIANTS, *_8B_VARIANTS)
ROWS = {
    r.name: r
    for r in [
        Row("1b_eager", 1, "1B", 2048, 8, compile=False, titanrush_variants=_1B_VARIANTS),
        Row("1b_compile", 1, "1B", 2048, 8, compile=True),
        Row("1b_compile_float8", 1, "1B", 2048, 8, compile=True, float8=True),
        Row("1b_compile_b16", 1, "1B", 2048, 16, compile=True),
        Row("8b_eager", 4, "8B", 8192, 2, compile=False, ac="op", titanrush_variants=_8B_VARIANTS),
        Row("8b_compile", 4, "8B", 8192, 2, compile=True, ac="op", titanrush_variants=_8B_VARIANTS),
        Row(
            "8b_compile_float8",
            4,
            "8B",
            8192,
            2,
            compile=True,
            float8=True,
            ac="op",
            titanrush_variants=_8B_VARIANTS,
        ),
    ]
}


# ---------------------------------------------------------------- the shared corpus and tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's, which Llama 3 uses)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_hf_tokenizer(folder: Path) -> None:
    """titanrush's BPE as a Hugging Face `tokenizer.json` (+ `tokenizer_config.json` naming BOS/EOS).

    Ranks become the byte-level vocabulary; each multi-byte token's merges are the splits into two
    tokens that both exist, ordered by the merged token's rank (how tiktoken ranks apply).
    """
    from titanrush.data.tokenizer import DEFAULT_PATH, LLAMA3_PATTERN, special_tokens

    enc = _bytes_to_unicode()
    ranks = {}
    for line in DEFAULT_PATH.read_text().splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    text = {b: "".join(enc[c] for c in b) for b in ranks}
    merges = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, max(ranks[left], ranks[right]), text[left], text[right]))
    merges.sort()
    specials = special_tokens()
    added = [
        {
            "id": len(ranks) + i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in enumerate(specials)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": LLAMA3_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text[b]: r for b, r in ranks.items()},
            "merges": [[left, right] for _, _, left, right in merges],
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    config = {"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_corpus(path: Path) -> None:
    """The embedded dataset's training documents (stdlib sources) as JSON lines of {"text": ...}."""
    from titanrush.data.sources import embedded_documents

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for doc in embedded_documents("train"):
            fh.write(json.dumps({"text": doc.text}) + "\n")


# ---------------------------------------------------------------- commands


def torchtitan_toml(
    row: Row,
    steps: int,
    assets: Path,
    corpus: Path,
    dump: Path,
    snapshot_step: int = 0,
    profile_step: int = 0,
    profile_steps: int = 1,
) -> str:
    profiling = ""
    if snapshot_step:
        profiling = f"\n[profiling]\nenable_memory_snapshot = true\nprofile_freq = {snapshot_step}\n"
    elif profile_step:  # the traced steps after one warm-up step, like titanrush's profiler
        profiling = (
            f"\n[profiling]\nenable_profiling = true\nprofile_freq = {profile_step}\n"
            f"profiler_warmup = 1\nprofiler_active = {profile_steps}\n"
        )
    converters = '["quantize.linear.float8"]' if row.float8 else "[]"
    ac = 'mode = "selective"\nselective_ac_option = "op"' if row.ac == "op" else 'mode = "none"'
    return f"""[job]
dump_folder = "{dump}"
description = "{row.name}"

[metrics]
log_freq = 1
disable_color_printing = true

[model]
name = "llama3"
flavor = "{row.flavor}"
hf_assets_path = "{assets}"
converters = {converters}

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8
implementation = "fused"

[lr_scheduler]
warmup_steps = 10

[training]
local_batch_size = {row.batch}
seq_len = {row.seq_len}
max_norm = 1.0
steps = {steps}
dataset = "c4_test"
dataset_path = "{corpus}"
mixed_precision_param = "bfloat16"
mixed_precision_reduce = "float32"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1

[checkpoint]
enable = false

[activation_checkpoint]
{ac}

[compile]
enable = {str(row.compile).lower()}
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
filter_fqns = ["output"]

[experimental]
custom_import = "tt_flavors"
{profiling}"""


def titanrush_args(row: Row) -> list[str]:
    if row.flavor == "1B":
        args = ["--config", "train_configs/llama1b_single.toml", "--model.tie_embeddings", "untied"]
    else:
        args = ["--config", "train_configs/llama8b_fsdp.toml", "--checkpoint.enable", "false"]
    args += ["--training.local_batch_size", str(row.batch), "--training.seq_len", str(row.seq_len)]
    args += ["--compile.enable" if row.compile else "--no-compile.enable"]
    if row.float8:
        args += ["--float8.enable"]
    args += ["--activation_checkpoint.mode", "selective" if row.ac == "op" else "none"]
    return args


def snapshot_args(step: int) -> list[str]:
    """titanrush's flags for a CUDA memory snapshot dumped after `step` (none for 0)."""
    return [*profile_args(step), "--profiling.memory_snapshot"] if step else []


def profile_args(step: int, active: int = 1) -> list[str]:
    """titanrush's flags for one torch.profiler trace of the `active` steps ending at `step` (none for 0)."""
    if not step:
        return []
    return ["--profiling.enable", "--profiling.freq", str(step), "--profiling.active_steps", str(active)]


def traces(work: Path, step: int, names: set[str] | None = None) -> list[tuple[str, Path]]:
    """The rank-0 traces of `step` the runs wrote: (label, path), torchtitan's and titanrush's.

    `names`: only these rows (torchtitan) and run tags (titanrush), i.e. this invocation's runs, not
    older ones left in the same folder.
    """
    tt = sorted(work.glob(f"tt_dump/*/profile_traces/iteration_{step}/rank0_trace.json"))
    ours = sorted(work.glob(f"tr_dump/*/profile/step-{step}/rank0.trace.json.gz"))
    found = [("torchtitan", p) for p in tt] + [("titanrush", p) for p in ours]
    return [
        (f"{trainer} {p.parents[2].name}, step {step}", p)
        for trainer, p in found
        if names is None or p.parents[2].name in names
    ]


def launcher(ngpu: int, *, always_torchrun: bool = False) -> list[str]:
    """The launch prefix; torchtitan reads LOCAL_RANK even on one GPU, so it always goes through torchrun."""
    if ngpu == 1 and not always_torchrun:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ngpu}"]


# ---------------------------------------------------------------- running and parsing

_TT_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
_TR_STEP = re.compile(r"INFO step\s+(\d+)\s+loss\s+([-\d.]+)")


@dataclass
class Run:
    trainer: str
    row: str
    variant: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    metrics: Path | None = None  # titanrush's metrics.jsonl
    result: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return run_tag(self.row, self.variant)


def run_tag(row: str, variant: str) -> str:
    """A run's name: the row, with `+variant` for a titanrush variant (its job name and log name)."""
    return row if variant in ("same", "-") else f"{row}+{variant}"


def fresh_compile_caches(base: Path | None, tag: str) -> dict[str, str]:
    """With `base`: new, empty folders under it for titanrush's Python bytecode and for inductor's,
    Triton's and flash-attn-4's compiled kernels, as the variables that point a run at them (each run
    then compiles from nothing, as on a fresh machine); without: nothing (the machine's caches, warm
    from the runs before)."""
    if base is None:
        return {}
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=tag.replace("+", "_") + ".", dir=base))
    return {
        "TITANRUSH_PYCACHE": str(folder / "pycache"),  # titanrush's bytecode (titanrush/bytecode.py)
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(folder / "flash"),  # flash-attn-4's compiled kernels
    }


def execute(run: Run, timeout: float, gpu: str | None = None, caches: Path | None = None) -> None:
    """Run the command, timestamping each log line; fill run.result with the steady-state figures.

    With `gpu`, the run sees only that GPU, its log is named after it, and titanrush's metrics file is
    moved aside afterwards (to `metrics.gpu<G>.jsonl`), so a repeat on the other GPU starts a fresh one.
    With `caches`, the run compiles into empty cache folders made there (`fresh_compile_caches`).
    """
    t0 = time.monotonic()
    first_step_s = None
    steps: list[dict] = []
    pat = _TT_STEP if run.trainer == "torchtitan" else _TR_STEP
    env = run.env if gpu is None else {**run.env, "CUDA_VISIBLE_DEVICES": gpu}
    env = {**env, **fresh_compile_caches(caches, f"{run.trainer}_{run.tag}")}
    log_path = run.log if gpu is None else run.log.with_name(f"{run.log.stem}.gpu{gpu}{run.log.suffix}")
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(run.cmd) + "\n")
        proc = subprocess.Popen(
            run.cmd,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # a timeout stops torchrun's ranks too, not only the launcher
        )
        timer = threading.Timer(timeout, kill_group, [proc])
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = pat.search(line)
            if m:
                if first_step_s is None:
                    first_step_s = time.monotonic() - t0
                if run.trainer == "torchtitan":
                    steps.append(
                        {
                            "step": int(m[1]),
                            "loss": float(m[2]),
                            "mem_reserved_gib": float(m[3]),
                            "tps": float(m[4].replace(",", "")),
                        }
                    )
        rc = proc.wait()
        timer.cancel()
    if run.trainer == "titanrush" and run.metrics:
        steps = [s for s in read_metrics(run.metrics) if "loss" in s and "tps" in s]
        if gpu is not None and run.metrics.exists():
            run.metrics.rename(run.metrics.with_name(f"metrics.gpu{gpu}.jsonl"))
    if rc == 0:
        status = "ok"
    elif detect_oom(log_path.read_text(errors="replace")):
        status = "OOM"
    else:
        status = "timeout" if time.monotonic() - t0 >= timeout else f"failed ({rc})"
    run.result = {
        "status": status,
        "first_step_s": first_step_s,
        "wall_s": time.monotonic() - t0,
        "steps": steps,
    }


def summarize(run: Run, measure_from: int) -> dict:
    steady = [s for s in run.result.get("steps", []) if s["step"] >= measure_from]
    out = {
        "trainer": run.trainer,
        "row": run.row,
        "variant": run.variant,
        "status": run.result.get("status"),
        "first_step_s": run.result.get("first_step_s"),
        "command": shlex.join(run.cmd),
    }
    if steady:
        out["tps"] = sum(s["tps"] for s in steady) / len(steady)
        mem = [s["mem_reserved_gib"] for s in steady if s.get("mem_reserved_gib") is not None]
        out["mem_reserved_gib"] = max(mem) if mem else None
        out["steps_measured"] = f"{steady[0]['step']}-{steady[-1]['step']}"
        out["final_loss"] = steady[-1]["loss"]
    elif out["status"] == "ok":
        out["status"] = "no steps logged"
    return out


def ratio_table(results: list[dict]) -> str:
    """One line per row and titanrush variant: torchtitan's figures, ours, and the ratios."""
    lines = [
        "| row | titanrush variant | torchtitan tok/s/GPU | titanrush tok/s/GPU | ratio | torchtitan GiB | "
        "titanrush GiB | memory ratio | torchtitan first step s | titanrush first step s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-"

    for name in dict.fromkeys(r["row"] for r in results):
        tt = [r for r in results if r["row"] == name and r["trainer"] == "torchtitan"]
        ref = _mean_of(tt)
        for variant in dict.fromkeys(
            r["variant"] for r in results if r["row"] == name and r["trainer"] == "titanrush"
        ):
            ours = _mean_of(
                [
                    r
                    for r in results
                    if r["row"] == name and r["trainer"] == "titanrush" and r["variant"] == variant
                ]
            )
            tps_ratio = speedup(ours.get("tps"), ref.get("tps"))
            mem_ratio = speedup(ours.get("mem_reserved_gib"), ref.get("mem_reserved_gib"))
            cells = [
                name,
                variant,
                f"{fmt(ref.get('tps'), ',.0f')} {_flag(ref)}".strip(),
                f"{fmt(ours.get('tps'), ',.0f')} {_flag(ours)}".strip(),
                f"{fmt(tps_ratio, '.3f')}x",
                fmt(ref.get("mem_reserved_gib"), ".1f"),
                fmt(ours.get("mem_reserved_gib"), ".1f"),
                fmt(mem_ratio, ".2f"),
                fmt(ref.get("first_step_s"), ".0f"),
                fmt(ours.get("first_step_s"), ".0f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _flag(r: dict) -> str:
    return "" if r.get("status") == "ok" else f"({r.get('status')}) "


def _mean_of(runs: list[dict]) -> dict:
    """One figure from the repeats of a run (the GPU-swapped pair); status ok only if all were."""
    if not runs:
        return {"status": "not run"}
    out: dict = {"status": "ok" if all(r["status"] == "ok" for r in runs) else runs[0]["status"]}
    for key in ("tps", "mem_reserved_gib", "first_step_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if not vals or out["status"] != "ok":
            out[key] = None
        else:  # memory: the larger peak of the repeats; speed and start-up time: the mean
            out[key] = max(vals) if key == "mem_reserved_gib" else sum(vals) / len(vals)
    return out


# ---------------------------------------------------------------- main


def plan(rows: list[Row], trainers: list[str], a: argparse.Namespace, work: Path) -> list[Run]:
    runs = []
    compat = ROOT / "scripts" / "torchtitan_compat"
    try:
        import datasets  # noqa: F401

        tt_path = str(compat)
    except ImportError:  # the stand-in (torchtitan_compat/shim/datasets) goes on the path
        tt_path = f"{compat}:{compat / 'shim'}"
    # Both trainers get the same allocator: `expandable`, as both launchers set it (torchtitan's
    # run_train.sh exports it; titanrush's trainer sets it by default); `default`, neither (the issue's
    # reference figures and this script's runs before 2026-11-21's offload work).
    alloc = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"} if a.allocator == "expandable" else {}
    tt_path = os.pathsep.join(p for p in (tt_path, os.environ.get("PYTHONPATH")) if p)
    tt_env = child_env(PYTHONPATH=tt_path, **alloc)
    tr_env = child_env(**alloc)
    tr_alloc = [] if alloc else ["--training.expandable_segments", "false"]
    for row in rows:
        if "torchtitan" in trainers:
            toml = work / f"tt_{row.name}.toml"
            toml.write_text(
                torchtitan_toml(
                    row,
                    a.steps,
                    work / "tokenizer",
                    work / "corpus",
                    work / "tt_dump" / row.name,
                    a.memory_snapshot,
                    a.profile,
                    a.profile_steps,
                )
            )
            cmd = [
                *launcher(row.ngpu, always_torchrun=True),
                "-m",
                "torchtitan.train",
                "--job.config_file",
                str(toml),
            ]
            runs.append(Run("torchtitan", row.name, "-", cmd, tt_env, work / f"tt_{row.name}.log"))
        if "titanrush" in trainers:
            variants = {"same": [], **row.titanrush_variants}
            for variant, extra in variants.items():
                if variant not in a.variants:
                    continue
                tag = run_tag(row.name, variant)
                dump = work / "tr_dump"
                args = [
                    *titanrush_args(row),
                    *tr_alloc,
                    *extra,
                    *snapshot_args(a.memory_snapshot),
                    *profile_args(a.profile, a.profile_steps),
                    "--training.steps",
                    str(a.steps),
                    "--metrics.log_freq",
                    "1",
                    "--job.dump_folder",
                    str(dump),
                    "--job.name",
                    tag,
                ]
                cmd = [*launcher(row.ngpu), "-m", "titanrush.train", *args]
                runs.append(
                    Run(
                        "titanrush",
                        row.name,
                        variant,
                        cmd,
                        tr_env,
                        work / f"tr_{tag}.log",
                        metrics=dump / tag / "metrics.jsonl",
                    )
                )
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    ap.add_argument("--trainers", default="torchtitan,titanrush")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--measure-from", type=int, default=20)
    ap.add_argument("--gpus", default="", help="two GPU ids: run the 1-GPU rows of both trainers at once")
    ap.add_argument("--repeats", type=int, default=2, choices=(1, 2), help="with --gpus: 2 swaps the GPUs")
    ap.add_argument(
        "--variants",
        default="same,ac_alternate",
        help="titanrush variants, from: " + ",".join(VARIANTS),
    )
    ap.add_argument(
        "--ngpu",
        type=int,
        default=0,
        help="run the multi-GPU rows on this many GPUs instead of theirs (a proxy where fewer are lent; the "
        "header names the count)",
    )
    ap.add_argument(
        "--allocator",
        choices=("expandable", "default"),
        default="expandable",
        help="the CUDA caching allocator of both trainers: expandable segments (both launchers' setting) "
        "or PyTorch's default (the issue's reference figures)",
    )
    ap.add_argument("--timeout-per-run", type=float, default=400)
    ap.add_argument(
        "--fresh-compile-caches",
        action="store_true",
        help="each run compiles into empty inductor and Triton cache folders (DIR/compile_caches/): time to "
        "first step as on a fresh machine, for both trainers alike (flash-attn-4's own kernel cache is "
        "not emptied)",
    )
    ap.add_argument(
        "--memory-snapshot",
        type=int,
        default=0,
        metavar="STEP",
        help="both trainers dump a CUDA memory snapshot after STEP (python stacks; figures then include "
        "the recording's overhead): <dump>/memory_snapshot/",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEP",
        help="both trainers write a torch.profiler trace of the --profile-steps steps ending at STEP "
        "(>= 3 + those steps; figures then include the profiler's overhead); DIR/profiles.txt summarizes "
        "rank 0's (scripts/trace_summary.py)",
    )
    ap.add_argument(
        "--profile-steps", type=int, default=1, help="with --profile: the traced steps, ending at STEP"
    )
    ap.add_argument("--top-kernels", type=int, default=25, help="with --profile: kernels listed per trace")
    ap.add_argument(
        "--gaps", type=int, default=0, help="with --profile: the N longest stretches without compute"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="write the configs, print the commands, run nothing"
    )
    a = ap.parse_args()
    a.variants = a.variants.split(",")
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    unknown = [r for r in a.rows.split(",") if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    rows = [ROWS[r] for r in a.rows.split(",")]
    if a.ngpu:
        rows = [dataclasses.replace(r, ngpu=a.ngpu) if r.ngpu > 1 else r for r in rows]
    ngpu = {r.name: r.ngpu for r in rows}
    if a.profile and a.memory_snapshot:
        ap.error("--profile and --memory-snapshot share each trainer's profiling settings: give one")
    if a.profile_steps < 1:
        ap.error(f"--profile-steps {a.profile_steps}: trace at least one step")
    if a.profile and not 3 + a.profile_steps <= a.profile <= a.steps:
        ap.error(
            f"--profile {a.profile}: the traced steps must end in {3 + a.profile_steps}..--steps ({a.steps})"
        )
    trainers = a.trainers.split(",")
    work = a.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if "torchtitan" in trainers:
        write_hf_tokenizer(work / "tokenizer")
        write_corpus(work / "corpus" / "stdlib.jsonl")
    runs = plan(rows, trainers, a, work)
    if a.dry_run:
        for r in runs:
            print(f"[{r.trainer} {r.row} {r.variant}] {shlex.join(r.cmd)}")
        return 0
    env = environment()
    results: list[dict] = []
    gpus = [g for g in a.gpus.split(",") if g]
    caches = work / "compile_caches" if a.fresh_compile_caches else None
    cache_note = "fresh per run" if caches else "the machine's (warm after its first runs)"

    def record(run: Run, gpu: str | None) -> None:
        s = summarize(run, a.measure_from)
        s["gpu"] = gpu
        results.append(s)
        with open(work / "results.jsonl", "a") as fh:
            fh.write(json.dumps({**s, "env": env}) + "\n")
        print(
            f"[side-by-side] {run.trainer} {run.row} {run.variant} gpu={gpu}: {s['status']} "
            f"tps={s.get('tps')} mem={s.get('mem_reserved_gib')} first={s.get('first_step_s')}",
            flush=True,
        )

    pending = list(runs)
    while pending:
        run = pending.pop(0)
        partner = next((p for p in pending if p.row == run.row and p.trainer != run.trainer), None)
        if len(gpus) >= 2 and ngpu[run.row] == 1 and partner is not None:
            pending.remove(partner)
            for order in range(a.repeats):  # with 2: each trainer on each GPU once
                pair = [(run, gpus[order]), (partner, gpus[1 - order])]
                threads = [
                    threading.Thread(target=execute, args=(r, a.timeout_per_run, g, caches)) for r, g in pair
                ]
                for t in threads:
                    t.start()
                for t, (r, g) in zip(threads, pair):
                    t.join()
                    record(r, g)
        else:
            execute(run, a.timeout_per_run, caches=caches)
            record(run, os.environ.get("CUDA_VISIBLE_DEVICES"))
    md = ratio_table(results)
    header = (
        f"{env['date']}, {env['gpus']} x {env['device']}, torch {env['torch']}, titanrush commit "
        f"{env['commit']}, torchtitan {_tt_version()}; {a.steps} steps, means over steps >= "
        f"{a.measure_from}; allocator: {a.allocator}; compile caches: {cache_note}"
    )
    commands = "\n".join(f"- {r['trainer']} {r['row']} ({r['variant']}): `{r['command']}`" for r in results)
    (work / "results.md").write_text(f"{header}\n\n{md}\n\nCommands:\n\n{commands}\n")
    print(header)
    print(md)
    if a.profile:
        write_profiles(work, a.profile, {r.tag for r in runs}, a.top_kernels, a.gaps)
    return 0


def write_profiles(work: Path, step: int, names: set[str], top: int, gaps: int = 0) -> None:
    """DIR/profiles.txt: trace_summary's view of the rank-0 traces of `step` this invocation's runs left."""
    import trace_summary

    parts = []
    for label, path in traces(work, step, names):
        try:
            summary = trace_summary.summarize(trace_summary.load(path))
            parts.append(trace_summary.render(label, summary, top, gaps))
        except (OSError, ValueError) as e:  # one unreadable trace does not hide the others
            parts.append(f"== {label}: unreadable trace {path}: {e}")
    (work / "profiles.txt").write_text("\n\n".join(parts) + "\n")
    print("\n\n".join(parts))


def _tt_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchtitan")
    except Exception:  # noqa: BLE001 - only a label in the report
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
