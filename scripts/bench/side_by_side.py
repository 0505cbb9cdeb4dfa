"""titanrush beside torchtitan 0.2.2 on the same GPUs: the table of docs/benchmarks/performance.md.

Run on the GPU machine from the repo root with torchtitan 0.2.2 importable (gpu_check.sh does); --help.
A row fixes the work; per row torchtitan runs once, then titanrush once per setting (`same`: torchtitan's
work exactly, AC policy and pipeline split included; `defaults`; `best`) and `--base DIR` another
checkout, one run at a time. `--balance`: Llama 4 rows warm up over 100 steps, routing bias step 1e-2
(with `defaults` titanrush keeps its balance loss, which torchtitan 0.2.2 lacks; `same` turns it off).
Per run: tokens/s per GPU (mean from --measure-from), peak reserved GiB, MFU, time to first step, ratio to
the row's torchtitan run; in DIR/results.jsonl each logged loss, titanrush's routing imbalance (Llama 4),
with --profile-step where rank 0's profiled step went, its kernels. Writes DIR/results.{jsonl,md}, logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMPAT = Path(__file__).resolve().parent / "torchtitan_compat"
sys.path.insert(0, str(ROOT))

from titanrush.data.hf_tokenizer import write_hf_tokenizer  # noqa: E402
from titanrush.models.llama.flavors import model_args  # noqa: E402
from titanrush.tools.rush_moe import load_windows  # noqa: E402
from titanrush.tools.rush_report import git_commit  # noqa: E402
from titanrush.tools.rush_runner import detect_oom, kill_group, read_metrics  # noqa: E402
from titanrush.tools.trace_analysis import (  # noqa: E402
    collectives,
    comparison,
    kernels,
    read_trace,
    timeline,
)

_OP_AC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "op"]
_NO_AC = ["--activation_checkpoint.mode", "none"]
_ZERO2 = ["--parallelism.fsdp_reshard_after_forward", "never"]
_CHUNKED = ["--training.loss", "chunked"]  # (not with TP or PP)
_AUTO = [  # the planner's choice of each lever it can pick (docs/auto_plan.md)
    "--activation_checkpoint.mode",
    "auto",
    "--training.loss",
    "auto",
    "--parallelism.fsdp_reshard_after_forward",
    "auto",
]
BALANCE = ["--lr_scheduler.warmup_steps", "100", "--moe.bias_update_rate", "1e-2"]  # --balance


@dataclass(frozen=True)
class Row:
    """The work both trainers do; `best` is titanrush's best AC, FSDP and loss flags for it."""

    name: str
    flavor: str
    ngpu: int
    seq_len: int
    batch: int
    ac: bool = True  # selective per-op activation checkpointing (torchtitan's `op`)
    float8: bool = False
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel (Llama 4 rows)
    async_tp: bool = False  # both trainers' async TP switch on (torchtitan 0.2.2's fuses nothing on 2.11)
    tt: bool = True  # False: torchtitan cannot do the same work (it trains TP without FSDP in fp32 only)
    best: tuple[str, ...] = ()  # empty: the row's defaults


_8B_BEST = (*_NO_AC, *_ZERO2, *_CHUNKED)  # estimated 117 GiB per H200 (87 with float8)
ROWS = {
    r.name: r
    for r in (
        Row("1b", "1B", 1, 2048, 8, ac=False),
        Row("3b", "3B", 1, 8192, 2),  # torchtitan's AC policy as its recipes ship it (per-op)
        Row("1b_fsdp2", "1B", 2, 2048, 4, ac=False),  # the 1b row's 8 sequences a step over FSDP 2
        Row("3b_fsdp2", "3B", 2, 8192, 2, best=(*_NO_AC, *_CHUNKED)),  # estimated 68 GiB: fits 80 GB
        Row("8b_fsdp2", "8B", 2, 8192, 2, best=(*_OP_AC, *_CHUNKED)),  # no AC: does not fit 2 x 141 GB
        Row("8b_fsdp4", "8B", 4, 8192, 2, best=_8B_BEST),
        Row("8b_fsdp4_float8", "8B", 4, 8192, 2, float8=True, best=_8B_BEST),
        Row("8b_tp2", "8B", 2, 8192, 2, tp=2, tt=False),  # titanrush alone, its levers' A/B (--flags)
        Row("8b_tp2_fsdp2", "8B", 4, 8192, 2, tp=2, best=(*_NO_AC, *_ZERO2)),
        Row("8b_tp2_fsdp2_async", "8B", 4, 8192, 2, tp=2, async_tp=True, best=(*_NO_AC, *_ZERO2)),
        Row("8b_cp2", "8B", 2, 8192, 2, cp=2, best=(*_NO_AC, *_CHUNKED)),  # FSDP over the cp ranks (both)
        Row("8b_cp2_fsdp2", "8B", 4, 8192, 2, cp=2, best=_8B_BEST),
        Row("8b_pp2_fsdp2", "8B", 4, 8192, 4, pp=2, best=_NO_AC),  # PP keeps the weights gathered anyway
        # Llama 4 (MoE, 1.0B active; tt_flavors.py): 8 experts on 1 GPU; 16: FSDP, EP2 on 2, EP2 x FSDP2 on 4.
        Row("moe", "llama4_1Bx8E", 1, 4096, 2, ac=False),
        Row("moe_fsdp2", "llama4_1Bx16E", 2, 4096, 2, ac=False),
        Row("moe_ep2", "llama4_1Bx16E", 2, 4096, 2, ac=False, ep=2),
        Row("moe_ep2_fsdp4", "llama4_1Bx16E", 4, 4096, 2, ac=False, ep=2),
        # The debug models, for the parity mode on the CPU (tt_flavors.py, tt_cpu.py).
        Row("debug", "debug", 1, 128, 4, ac=False),
        Row("moe_debug", "llama4_debug", 1, 128, 4, ac=False),
    )
}
SETTINGS = ("same", "defaults", "best", "auto")
TT_AC = {  # torchtitan's activation checkpointing by --tt-ac name (`op`: its Llama 3 recipes' policy)
    "none": {"mode": "none"},
    "op": {"mode": "selective", "selective_ac_option": "op"},
    "full": {"mode": "full"},
}


def row_flags(row: Row) -> list[str]:
    """titanrush's flags for the row's work (the settings add activation checkpointing and the rest)."""
    flags = [
        "--model.flavor",
        row.flavor,
        "--training.seq_len",
        str(row.seq_len),
        "--training.local_batch_size",
        str(row.batch),
        "--training.precision",
        "bf16",
        "--optimizer.lr",
        "3e-4",
        "--optimizer.eps",
        "1e-8",
        "--lr_scheduler.warmup_steps",
        "10",
        "--training.max_norm",
        "1.0",
        "--compile.enable",
        "--data.dataset",
        "embedded",
    ]
    if row.flavor != "8B":  # Llama 3.2 ties its embeddings; torchtitan's llama3 never does
        flags += ["--model.tie_embeddings", "untied"]
    for key, degree in (("tp", row.tp), ("cp", row.cp), ("pp", row.pp), ("ep", row.ep)):
        flags += [f"--parallelism.{key}", str(degree)] if degree > 1 else []
    if row.pp > 1:  # torchtitan's default: 1F1B, micro-batches of one sequence
        flags += ["--parallelism.pp_schedule", "1F1B", "--parallelism.pp_microbatches", str(row.batch)]
    return flags + (["--float8.enable"] if row.float8 else []) + (["--experimental.async_tp"] * row.async_tp)


def even_split(row: Row) -> list[int]:
    """torchtitan's layers per stage: embedding, output count as a layer, spread evenly (8B, pp 2: 16/16)."""
    units, pp = model_args(row.flavor).n_layers + 2, row.pp
    split = [units // pp + (i < units % pp) for i in range(pp)]  # the first stages take the remainder
    return [split[0] - 1, *split[1:-1], split[-1] - 1]


def setting_flags(row: Row) -> dict[str, list[str]]:
    """Each named setting's titanrush flags for this row, on top of `row_flags`; `same` splits a pipeline's
    layers evenly, as torchtitan does (titanrush's default weighs each stage's cost), and routes Llama 4's
    tokens as torchtitan does (the others keep titanrush's balancing defaults), and steps torch's fused
    AdamW after a clip pass of its own, as torchtitan does (the others fold the clip into the optimizer)."""
    same = [*_OP_AC, "--activation_checkpoint.op_matmuls", "alternate"] if row.ac else _NO_AC
    same = [*same, "--optimizer.implementation", "fused"]
    if row.pp > 1:
        same = [*same, "--parallelism.pp_layers_per_stage", ",".join(map(str, even_split(row)))]
    if row.flavor.startswith("llama4"):  # torchtitan 0.2.2's routing: bias step 1e-3, no balance loss
        same = [*same, "--moe.bias_update_rate", "1e-3", "--moe.aux_loss_coeff", "0"]
    defaults = _OP_AC if row.ac else _NO_AC
    return {"same": same, "defaults": defaults, "best": list(row.best) or defaults, "auto": _AUTO}


def torchtitan_config(
    row: Row,
    steps: int,
    assets: Path,
    corpus: Path,
    dump: Path,
    profile_step: int = 0,
    warmup: int = 10,
    log_freq: int = 1,
    ac: str = "",
) -> dict[str, dict]:
    """torchtitan's job config for the row, by TOML section; with `profile_step`, its profiler records
    that step (after one warm-up step, as titanrush's); `ac` a `TT_AC` name (empty: the row's own)."""
    ac_mode = TT_AC[ac or row_ac(row)]
    cfg = {
        "job": {"dump_folder": str(dump)},
        "metrics": {"log_freq": log_freq, "disable_color_printing": True},
        "model": {
            "name": "llama4" if row.flavor.startswith("llama4") else "llama3",
            "flavor": row.flavor,
            "hf_assets_path": str(assets),
            "converters": ["quantize.linear.float8"] if row.float8 else [],
        },
        "optimizer": {"name": "AdamW", "lr": 3e-4, "eps": 1e-8, "implementation": "fused"},
        "lr_scheduler": {"warmup_steps": warmup},
        "training": {
            "local_batch_size": row.batch,
            "seq_len": row.seq_len,
            "max_norm": 1.0,
            "steps": steps,
            "dataset": "c4_test",
            "dataset_path": str(corpus),
            "mixed_precision_param": "bfloat16",
            "mixed_precision_reduce": "float32",
        },
        "parallelism": {
            "data_parallel_shard_degree": -1,
            "tensor_parallel_degree": row.tp,
            "context_parallel_degree": row.cp,
            "pipeline_parallel_degree": row.pp,
            "expert_parallel_degree": row.ep,
            "enable_async_tensor_parallel": row.async_tp,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 1,
        },
        "checkpoint": {"enable": False},
        "activation_checkpoint": ac_mode,
        "compile": {"enable": True, "components": ["model", "loss"]},
        "quantize.linear.float8": {
            "enable_fsdp_float8_all_gather": True,
            "filter_fqns": ["output"],
            "precompute_float8_dynamic_scale_for_fsdp": True,
        },
        "experimental": {"custom_import": "tt_flavors"},
    }
    if profile_step:
        prof = {"enable_profiling": True, "profiler_active": 1, "profile_freq": profile_step}
        cfg["profiling"] = {**prof, "profiler_warmup": 1}  # traces: profile_traces/
    return cfg


def row_ac(row: Row) -> str:
    """The `TT_AC` name of the row's own work (the `same` setting's AC)."""
    return "op" if row.ac else "none"


def toml_text(cfg: dict[str, dict]) -> str:
    """A config of TOML sections as TOML (JSON values are TOML values here)."""
    return "\n".join(
        f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items()) for name, kv in cfg.items()
    )


def torchtitan_toml(row: Row, steps: int, assets: Path, corpus: Path, dump: Path, **kwargs: Any) -> str:
    """`torchtitan_config` as TOML."""
    return toml_text(torchtitan_config(row, steps, assets, corpus, dump, **kwargs))


# ---------------------------------------------------------------- planning


@dataclass
class Run:
    """One launch: which trainer, row and setting, the command, its environment and folder."""

    trainer: str  # torchtitan | titanrush | base
    row: str
    setting: str  # "-" for torchtitan
    cmd: list[str]
    env: dict[str, str]  # set on top of ours
    cwd: Path
    log: Path

    def shell(self) -> str:
        """The command as one would type it."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cd = f"cd {shlex.quote(str(self.cwd))} && " if self.cwd != ROOT else ""
        return f"{cd}{env} {shlex.join(self.cmd)}".strip()


def torchtitan_pythonpath() -> str:
    """torchtitan's PYTHONPATH: torchtitan_compat (flavors, parity spec), the `datasets` stand-in where the
    package is missing, then ours."""
    shim = [] if importlib.util.find_spec("datasets") else [str(COMPAT / "shim")]
    return os.pathsep.join([str(COMPAT), *shim, *filter(None, [os.environ.get("PYTHONPATH")])])


def tt_acs(row: Row, asked: list[str]) -> list[str]:
    """torchtitan's AC settings to run for the row, in order: `row` is the row's own."""
    return list(dict.fromkeys(row_ac(row) if ac == "row" else ac for ac in asked))


def plan(rows: list[Row], names: list[str], a: argparse.Namespace, work: Path) -> list[Run]:
    """The runs in order: per row torchtitan, then per setting titanrush and the base checkout."""
    tt_path = torchtitan_pythonpath()
    trainers = {"titanrush": ROOT, **({"base": a.base.resolve()} if a.base else {})}
    runs, profile = [], f"--profiling.enable --profiling.freq {a.profile_step} --profiling.active_steps 1"
    profile = profile.split() if a.profile_step else []  # titanrush's profiler: a warm-up step, then step N
    for row in rows:
        for ac in tt_acs(row, a.tt_ac) if "torchtitan" in a.trainers and row.tt else []:
            name = row.name if ac == row_ac(row) else f"{row.name}_ac{ac}"  # (the row's own work: its name)
            toml = work / "configs" / f"torchtitan_{name}.toml"
            toml.parent.mkdir(parents=True, exist_ok=True)
            balance = a.balance and row.flavor.startswith("llama4")
            tt = torchtitan_toml(
                row,
                a.steps,
                work / "tokenizer",
                work / "corpus",
                work / "tt" / name,
                profile_step=a.profile_step,
                warmup=100 if balance else 10,
                log_freq=a.log_freq,
                ac=ac,
            )
            toml.write_text(tt)
            nproc = [f"--nproc_per_node={row.ngpu}", "--local-ranks-filter", "0"]  # rank 0 logs, as ours
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                *nproc,
                "-m",
                "torchtitan.train",
                "--job.config_file",
                str(toml),
            ]
            env = {
                "PYTHONPATH": tt_path,
                "PYTORCH_ALLOC_CONF": "expandable_segments:True",
                "TT_LOAD_BALANCE_COEFF": "1e-2" if balance else "1e-3",
            }
            log = work / "logs" / f"torchtitan_{name}.log"
            setting = "-" if ac == row_ac(row) else f"ac {ac}"
            runs.append(Run("torchtitan", row.name, setting, cmd, env, ROOT, log))
        seen: list[list[str]] = []
        for setting, flags in setting_flags(row).items():
            if setting not in names or flags in seen:
                continue
            seen.append(flags)
            for trainer, checkout in trainers.items():
                if trainer == "titanrush" and "titanrush" not in a.trainers:
                    continue
                tag = f"{trainer}_{row.name}_{setting}"
                extra = BALANCE if a.balance and row.flavor.startswith("llama4") else []
                extra = extra + (shlex.split(a.flags) if trainer == "titanrush" else [])  # (not the base's)
                args = [
                    *row_flags(row),
                    *flags,
                    *extra,
                    "--training.steps",
                    str(a.steps),
                    "--job.name",
                    tag,
                    "--metrics.log_freq",
                    str(a.log_freq),
                    "--metrics.tensorboard",
                    "false",
                    "--job.dump_folder",
                    str(work / "runs"),
                    *profile,
                ]
                cmd = [str(checkout / "run_train.sh"), *args]
                runs.append(
                    Run(
                        trainer,
                        row.name,
                        setting,
                        cmd,
                        {"NGPU": str(row.ngpu)},
                        checkout,
                        work / "logs" / f"{tag}.log",
                    )
                )
    return runs


# titanrush's line, as it is now (`12:00:00 step 40  loss ...  tok/s 1,234 ...  mem 41.2GiB (30%)`, memory
# the reserved GiB) and as a base checkout before it may print it (`12:00:00 INFO step     40  loss ...
# tps 1,234 ...  reserved 41.20GiB ...`).
_STEP = {
    "torchtitan": r"step:\s*(\d+)\s+loss:",
    "titanrush": r"^\S+ (?:\[rank0\] )?(?:INFO )?step\s+(\d+)\s+loss",
}
_FIELDS = {
    "torchtitan": {
        "tps": r"tps: ([\d,.]+)",
        "mem_gib": r"memory:\s*([\d.]+)GiB",
        "mfu": r"mfu: ([\d.]+)%",
        "loss": r"loss:\s*([\d.]+)",
    },
    "titanrush": {
        "tps": r"(?:tok/s|tps) ([\d,.]+)",
        "mem_gib": (r"reserved ([\d.]+)GiB", r"  mem ([\d.]+)GiB"),  # (the older line's first)
        "mfu": r"mfu ([\d.]+)%",
        "loss": r"loss ([\d.]+)",  # the mean since the last logged step (its own step: metrics.jsonl)
        "loss_last": r"\(last ([\d.]+)\)",  # (the older line's step loss)
        "imbalance": r"(?:experts max/mean|busiest expert) ([\d.]+)",
    },
}


def parse_step(trainer: str, line: str) -> dict | None:
    """A step's figures from one log line of either trainer (the base is a titanrush), or None."""
    kind = "torchtitan" if trainer == "torchtitan" else "titanrush"
    m = re.search(_STEP[kind], line)
    if not m:
        return None
    out: dict = {"step": int(m[1])}
    for key, patterns in _FIELDS[kind].items():
        found = (re.search(p, line) for p in ((patterns,) if isinstance(patterns, str) else patterns))
        f = next((m for m in found if m), None)
        out[key] = float(f[1].replace(",", "")) if f else None
    return out


def execute(run: Run, timeout: float) -> dict:
    """Run the command in its own process group, killed after `timeout` s; the steps it logged."""
    run.log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    first_step_s, steps = None, []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **run.env}
    with open(run.log, "w") as log:
        log.write(f"$ {run.shell()}\n")
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "errors": "replace"}
        proc = subprocess.Popen(run.cmd, cwd=run.cwd, env=env, start_new_session=True, **out)
        timer = threading.Timer(timeout, kill_group, [proc])  # torchrun's ranks too
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            step = parse_step(run.trainer, line)
            if step is not None:
                first_step_s = first_step_s or time.monotonic() - t0
                steps.append(step)
        rc = proc.wait()
        timer.cancel()
    failed = "OOM" if rc and detect_oom(run.log.read_text(errors="replace")) else f"failed ({rc})"
    status = "ok" if rc == 0 else "timeout" if time.monotonic() - t0 >= timeout else failed
    return {"status": status, "first_step_s": first_step_s, "steps": steps}


def summarize(run: Run, result: dict, measure_from: int, profile_step: int = 0) -> dict:
    """The figures over the steps from `measure_from` on (a logged line stands for the steps since the one
    before, all measured or it is left out): means (tokens/s, MFU), peak reserved GiB; less each profiled
    step (every `profile_step`-th), its warm-up step and the step after (the trace's export)."""
    logged = result.get("steps", [])
    since = {s["step"]: before["step"] for before, s in zip([{"step": 0}, *logged], logged)}
    steady = [
        s
        for s in logged
        if since[s["step"]] >= measure_from - 1 and not (profile_step and (s["step"] + 1) % profile_step <= 2)
    ]
    out = {
        "trainer": run.trainer,
        "row": run.row,
        "setting": run.setting,
        "status": result["status"],
        "first_step_s": result.get("first_step_s"),
        "command": run.shell(),
    }
    for key in ("tps", "mfu", "mem_gib"):
        values = [(s[key], s["step"] - since[s["step"]]) for s in steady if s.get(key) is not None]
        mean = fmean([v for v, _ in values], weights=[n for _, n in values]) if values else None
        out[key] = max(v for v, _ in values) if values and key == "mem_gib" else mean
    if out["status"] == "ok" and not steady:
        out["status"] = "no steps logged"
    # Each logged step's own loss, as torchtitan logs it (titanrush's `loss` is the window's mean).
    own = [[s["step"], s.get("loss_last") or s["loss"]] for s in logged if s.get("loss") is not None]
    out["loss_curve"] = own
    out["imbalance_curve"] = [[s["step"], s["imbalance"]] for s in logged if s.get("imbalance") is not None]
    return out


def window_imbalance(metrics: Path, every: int = 10) -> list[list[float]]:
    """A Llama 4 run's load per `every` steps: [window's end, worst layer's max/mean, mean over layers] of
    the tokens per expert (metrics.jsonl's `moe_tokens_l<i>`) summed over the window's steps."""
    windows = load_windows(read_metrics(metrics), every)
    return [[last, round(max(x), 2), round(fmean(x), 2)] for _, last, x, _ in windows if x]


def trace_of(run: Run, work: Path) -> Path | None:
    """Rank 0's trace of the run's profiled step (the newest, where several were written)."""
    tt = run.trainer == "torchtitan"
    tt_dump = work / "tt" / run.log.stem.removeprefix("torchtitan_")
    where = (tt_dump / "profile_traces") if tt else (work / "runs" / run.log.stem / "profile")
    found = list(where.glob("iteration_*/rank0_trace.json" if tt else "step-*/rank0.trace.json.gz"))
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def timeline_table(results: list[dict]) -> str:
    """Rank 0's profiled step per run: ms (share of the step); compute kernels by kind (streams overlap)."""
    keys, kinds = ("compute", "exposed_comm", "copy", "idle"), ("matmul", "attention", "compiled", "other")
    head = [
        "row",
        "setting",
        "trainer",
        "step ms",
        "compute",
        "exposed comm.",
        "copies",
        "idle",
        "all comm.",
        "kernels: matmul / attention / Triton / other",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * 6 + "---|"]
    for r, t in ((r, r["timeline"]) for r in results if r.get("timeline")):
        cells = [r["row"], r["setting"], r["trainer"], f"{t['step']:.1f}"]
        cells += [f"{t[k]:.1f} ({100 * t[k] / t['step']:.0f}%)" for k in keys] + [f"{t['comm']:.1f}"]
        cells.append(" / ".join(f"{t.get('kernel_' + k, 0):.0f}" for k in kinds))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_tables(results: list[dict]) -> str:
    """Per titanrush run, its kernels and collectives beside its row's torchtitan run's (`comparison`)."""
    ref = {r["row"]: r for r in results if r["trainer"] == "torchtitan" and r.get("kernels")}
    runs = [r for r in results if r["trainer"] != "torchtitan" and r.get("kernels") and r["row"] in ref]
    tables = [comparison(ref[r["row"]], r, ("torchtitan", "titanrush")) for r in runs]
    return "".join(f"\n\n{r['row']}, {r['setting']}:\n\n{t}" for r, t in zip(runs, tables))


def table(results: list[dict]) -> str:
    """One line per run; `vs torchtitan` divides by the row's torchtitan run of the same work (its setting
    `-`), `vs tt op` by torchtitan with its recipes' per-op AC (as shipped), `vs tt best` by the row's
    fastest torchtitan run (tuned by hand: each --tt-ac tried), all of the same invocation."""
    head = "row | setting | trainer | status | tok/s/GPU | vs torchtitan | reserved GiB | MFU % | 1st step s"
    head += " | vs tt op | vs tt best"
    lines = [f"| {head} |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ok = [r for r in results if r["trainer"] == "torchtitan" and r["status"] == "ok" and r.get("tps")]
    ref = {r["row"]: r["tps"] for r in ok if r["setting"] == "-"}
    op = {r["row"]: r["tps"] for r in ok if r["setting"] == "ac op"}
    op |= {
        r["row"]: r["tps"] for r in ok if r["setting"] == "-" and ROWS.get(r["row"], Row("", "", 0, 0, 0)).ac
    }
    best = {row: max(r["tps"] for r in ok if r["row"] == row) for row in {r["row"] for r in ok}}

    def f(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def vs(r: dict, refs: dict) -> str:
        ratio = r["tps"] / refs[r["row"]] if r.get("tps") and refs.get(r["row"]) else None
        return f(ratio, ".3f") + ("x" if ratio else "")

    for r in results:
        cells = [
            r["row"],
            r["setting"],
            r["trainer"],
            r["status"],
            f(r.get("tps"), ",.0f"),
            vs(r, ref),
            f(r.get("mem_gib"), ".1f"),
            f(r.get("mfu"), ".1f"),
            f(r.get("first_step_s"), ".0f"),
            vs(r, op),
            vs(r, best),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment(base: Path | None) -> dict[str, str]:
    """Date, GPUs, torch, torchtitan, the checkouts' commits (or TITANRUSH_COMMIT, TITANRUSH_BASE_COMMIT)."""
    import torch

    count = torch.cuda.device_count()
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "gpus": str(count),
        "device": torch.cuda.get_device_name(0) if count else "cpu",
        "commit": git_commit(ROOT, "TITANRUSH_COMMIT"),
        "torchtitan": "not installed",
    }
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        env["torchtitan"] = importlib.metadata.version("torchtitan")
    if base:
        env["base_commit"] = git_commit(base, "TITANRUSH_BASE_COMMIT")
    return env


def auto_rows(parity: bool = False) -> list[str]:
    """This machine's row: by the number of GPUs and, on two, their memory (parity: debug on the CPU, 1b,
    1b_fsdp2)."""
    import torch

    count = torch.cuda.device_count()
    if parity:
        return ["1b_fsdp2" if count >= 2 else "1b" if count else "debug"]
    big = count >= 2 and torch.cuda.get_device_properties(0).total_memory >= 120 * 2**30
    return ["8b_fsdp4"] if count >= 4 else ["8b_fsdp2" if big else "3b_fsdp2"] if count >= 2 else ["1b"]


def write_corpus(path: Path) -> None:
    """The embedded dataset's training documents as JSON lines of {"text": ...}, for torchtitan."""
    from titanrush.data.sources import embedded_documents

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d.text}) + "\n" for d in embedded_documents("train")))


# ---------------------------------------------------------------- parity mode (parity.py)


def parity_flags(row: Row, steps: int, tag: str, work: Path, cpu: bool = False) -> list[str]:
    """titanrush's flags of a row's parity run (its checkpoint to load apart): the row's work, torchtitan's
    AC policy, parity.SETTINGS, every step logged; on the CPU in fp32, not compiled."""
    import parity

    moe = row.flavor.startswith("llama4")
    flags = [*row_flags(row), *setting_flags(row)["same"], *parity.titanrush_flags(moe)]
    if cpu:
        flags = [f for f in flags if f != "--compile.enable"]
        flags[flags.index("--training.precision") + 1] = "fp32"
    fixed = ["--training.steps", str(steps), "--job.name", tag, "--job.dump_folder", str(work / "runs")]
    return [*flags, *fixed, "--metrics.log_freq", "1", "--metrics.tensorboard", "false"]


def parity_runs(row: Row, a: argparse.Namespace, work: Path, prep: Any, cpu: bool = False) -> list[Run]:
    """A row's parity runs: torchtitan, titanrush, and with --ablate-schedule titanrush on torchtitan's
    learning-rate schedule; each writes its hashes under work/parity/<row>/<run>. On the CPU: fp32, not
    compiled, torchtitan through torchtitan_compat/tt_cpu.py."""
    import parity

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row.ngpu}"]
    launch += ["--local-ranks-filter", "0"]
    cfg = torchtitan_config(row, a.steps, prep.hf_dir, prep.dump, work / "tt" / f"parity_{row.name}")
    parity.torchtitan_parity(cfg, prep)
    if cpu:
        cfg["compile"]["enable"], cfg["training"]["mixed_precision_param"] = False, "float32"
    toml = work / "configs" / f"torchtitan_parity_{row.name}.toml"
    toml.parent.mkdir(parents=True, exist_ok=True)
    toml.write_text(toml_text(cfg))
    obs = work / "parity" / row.name
    env = {"PYTHONPATH": torchtitan_pythonpath(), "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    env |= {
        "TT_LOAD_BALANCE_COEFF": str(parity.SETTINGS["bias_update_rate"]),
        "TT_PARITY_OUT": str(obs / "torchtitan"),
    }
    trainer = [str(COMPAT / "tt_cpu.py")] if cpu else ["-m", "torchtitan.train"]
    tt = [*launch, *trainer, "--job.config_file", str(toml)]
    runs = [
        Run(
            "torchtitan",
            row.name,
            "parity",
            tt,
            env,
            ROOT,
            work / "logs" / f"torchtitan_parity_{row.name}.log",
        )
    ]
    load = ["--checkpoint.load_path", str(prep.checkpoint), "--checkpoint.load_model_only"]
    paths = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    ours = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(filter(None, paths)))}
    for schedule in ("titanrush", "torchtitan")[: 1 + a.ablate_schedule]:
        tag = f"titanrush_parity_{row.name}" + ("_tt_schedule" if schedule == "torchtitan" else "")
        observer = [str(ROOT / "scripts/bench/parity_observe.py"), "--parity-out", str(obs / tag)]
        flags = parity_flags(row, a.steps, tag, work, cpu)
        cmd = [*launch, *observer, "--lr-schedule", schedule, *flags, *load]
        setting = "parity" if schedule == "titanrush" else "parity, torchtitan's lr schedule"
        runs.append(Run("titanrush", row.name, setting, cmd, ours, ROOT, work / "logs" / f"{tag}.log"))
    return runs


def parity_main(a: argparse.Namespace, work: Path) -> int:
    """Per row: its inputs (`parity.prepare`), its runs one at a time, the report (`parity_report`):
    work/parity.md, parity.jsonl; the weights and batches under --scratch, removed after the row."""
    import parity
    import parity_report as report
    import torch

    rows, gpus = [ROWS[r] for r in a.rows], torch.cuda.device_count()
    cpu = gpus == 0
    if a.dry_run:
        for row in rows:
            for r in parity_runs(row, a, work, parity.Prepared.at(a.scratch / row.name), cpu):
                print(f"[{r.trainer} {r.row} {r.setting}] {r.shell()}")
        return 0
    env, sections, records = environment(None), [], []
    deadline = time.monotonic() + a.time_limit if a.time_limit else float("inf")
    for row in rows:
        if row.ngpu > max(gpus, 1):
            print(f"[parity] {row.name}: skipped (needs {row.ngpu} GPUs, {gpus} present)", flush=True)
            continue
        t0, scratch = time.monotonic(), a.scratch / row.name
        shutil.rmtree(scratch, ignore_errors=True)
        dp = row.ngpu // (row.tp * row.cp * row.pp)
        flags = parity_flags(row, a.steps, "-", work, cpu)
        try:
            prep = parity.prepare(flags, steps=a.steps, dp=dp, scratch=scratch)
        except Exception as e:  # (a full disk, say: the next row may still run)
            print(f"[parity] {row.name}: preparing the inputs failed: {e!r}", flush=True)
            records.append({"row": row.name, "status": f"prepare failed: {e!r}", "env": env})
            shutil.rmtree(scratch, ignore_errors=True)
            continue
        print(f"[parity] {row.name}: weights and batches in {time.monotonic() - t0:.0f} s", flush=True)
        status = {}
        for run in parity_runs(row, a, work, prep, cpu):
            left = deadline - time.monotonic()
            print(f"[parity] {run.trainer} {row.name} {run.setting} ...", flush=True)
            result = execute(run, min(a.timeout_per_run, left)) if left >= 60 else {"status": "skipped"}
            status[run.log.stem] = result["status"]
            print(f"[parity] {run.trainer} {row.name} {run.setting}: {result['status']}", flush=True)
        shutil.rmtree(scratch, ignore_errors=True)
        obs, moe = work / "parity" / row.name, row.flavor.startswith("llama4")
        tt = report.torchtitan_trace(obs / "torchtitan")
        tag = f"titanrush_parity_{row.name}"
        tr = report.titanrush_trace(work / "runs" / tag, obs / tag)
        inputs = report.check_inputs(tr, tt, prep.tokens, prep.weights)
        fig = report.compare(tr, tt, a.steps, moe)
        extra = ""
        if a.ablate_schedule:
            ab = report.titanrush_trace(work / "runs" / f"{tag}_tt_schedule", obs / f"{tag}_tt_schedule")
            extra = report.ablation(
                report.compare(ab, tr, a.steps, moe), report.compare(ab, tt, a.steps, moe)
            )
        where = "CPU, fp32, not compiled" if cpu else f"{row.ngpu} x {env['device']}, bf16, compiled"
        runs = "Runs: " + ", ".join(f"{k} {v}" for k, v in status.items()) + "."
        sections.append(report.markdown(f"{row.name}: {row.flavor}, {where}", inputs, fig, moe, extra, runs))
        records.append({"row": row.name, "status": status, "inputs": inputs, **fig, "env": env})
        print(sections[-1], flush=True)
    header = (
        f"{env['date']}, {f'{gpus} x ' if gpus else ''}{env['device']}, torch {env['torch']}, titanrush "
        f"commit {env['commit']}, torchtitan {env['torchtitan']}; {a.steps} steps, parity settings "
        f"{parity.SETTINGS}"
    )
    report.write(work, sections, header, records)
    ok = [
        r.get("inputs", {}).get("identical") and r.get("goal_first") and r.get("goal_last") for r in records
    ]
    return 0 if ok and all(ok) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rows", default="auto", help=f"auto, or comma-separated from: {', '.join(ROWS)}")
    ap.add_argument(
        "--settings", default="same,defaults,best", help=f"comma-separated: {', '.join(SETTINGS)}"
    )
    ap.add_argument(
        "--steps", type=int, help="a multiple of --log-freq (torchtitan's last log); 30, parity 200"
    )
    ap.add_argument("--measure-from", type=int, default=10)
    ap.add_argument("--log-freq", type=int, help="both log every N steps (10; 1 with --profile-step)")
    ap.add_argument("--base", type=Path, help="another titanrush checkout, run at the same rows and settings")
    ap.add_argument("--trainers", default="torchtitan,titanrush", help="leave one out to run the other alone")
    ap.add_argument(
        "--tt-ac",
        default="row",
        help=f"torchtitan's AC per row, comma-separated from: row (the row's own work), {', '.join(TT_AC)}",
    )
    ap.add_argument("--timeout-per-run", type=float, default=300)
    ap.add_argument("--time-limit", type=float, default=0, help="seconds for all runs (0: none)")
    ap.add_argument("--profile-step", type=int, default=0, help="both trainers profile this step (>= 4)")
    ap.add_argument("--balance", action="store_true", help="Llama 4 rows: warm-up 100, bias step 1e-2")
    ap.add_argument("--flags", default="", help='--flags="...": more titanrush flags on its runs')
    ap.add_argument("--dry-run", action="store_true", help="print the commands in order, run nothing")
    ap.add_argument("--parity", action="store_true", help="parity mode: the same weights, batches, settings")
    ap.add_argument(
        "--ablate-schedule", action="store_true", help="parity: also titanrush on torchtitan's lr"
    )
    ap.add_argument(
        "--scratch", type=Path, default=Path("/tmp/titanrush_parity"), help="parity: weights, batches"
    )
    a = ap.parse_args(argv)
    a.rows = auto_rows(a.parity) if a.rows == "auto" else a.rows.split(",")
    a.settings, a.trainers, a.tt_ac = a.settings.split(","), a.trainers.split(","), a.tt_ac.split(",")
    for given, known, what in (
        (a.rows, ROWS, "rows"),
        (a.settings, SETTINGS, "settings"),
        (a.tt_ac, ("row", *TT_AC), "--tt-ac settings"),
    ):
        if bad := [x for x in given if x not in known]:
            ap.error(f"unknown {what} {bad}; choose from {', '.join(known)}")
    a.steps = a.steps or (200 if a.parity else 30)
    if a.parity:
        if a.base or a.flags or a.balance or a.profile_step or a.trainers != ["torchtitan", "titanrush"]:
            ap.error("--parity runs both trainers at the same settings: no --base, --flags, --balance, ...")
        if bad := [r for r in a.rows if ROWS[r].pp > 1 or not ROWS[r].tt]:
            ap.error(f"--parity: rows {bad} have a pipeline or no torchtitan run")
        a.log_freq, a.settings, a.measure_from = a.log_freq or 1, ["same"], 1  # (no speed figures)
    elif a.ablate_schedule:
        ap.error("--ablate-schedule is part of --parity")
    if a.base and not (a.base / "run_train.sh").exists():
        ap.error(f"--base {a.base}: no titanrush checkout there (no run_train.sh)")
    if a.profile_step and not 4 <= a.profile_step <= a.steps:
        ap.error(f"--profile-step {a.profile_step} must be in 4..--steps ({a.steps})")
    a.log_freq = a.log_freq or (1 if a.profile_step else 10)  # (10: torchtitan's default)
    if a.profile_step and a.log_freq != 1:
        ap.error("--profile-step needs --log-freq 1 (a logged line would stand for the profiled steps too)")
    if a.steps % a.log_freq:  # (titanrush logs its last step, torchtitan only every log_freq-th)
        ap.error(f"--steps {a.steps} must be a multiple of --log-freq {a.log_freq}")
    if not 1 <= a.measure_from <= a.steps:
        ap.error(f"--measure-from {a.measure_from} must be in 1..--steps ({a.steps})")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = a.out.resolve()
    if a.parity:
        return parity_main(a, work)
    runs = plan([ROWS[r] for r in a.rows], a.settings, a, work)
    if a.dry_run:
        return print("\n".join(f"[{r.trainer} {r.row} {r.setting}] {r.shell()}" for r in runs)) or 0
    import torch

    if "torchtitan" in a.trainers:
        write_hf_tokenizer(work / "tokenizer")
        write_corpus(work / "corpus" / "stdlib.jsonl")
    (work / "results.jsonl").unlink(missing_ok=True)
    env, gpus, results = environment(a.base), torch.cuda.device_count(), []
    deadline = time.monotonic() + a.time_limit if a.time_limit else float("inf")
    for run in runs:
        need, left = ROWS[run.row].ngpu, deadline - time.monotonic()
        if need > gpus:
            result = {"status": f"skipped (needs {need} GPUs, {gpus} present)"}
        elif left < 60:
            result = {"status": "skipped (time limit)"}
        else:
            print(f"[side-by-side] {run.trainer} {run.row} {run.setting} ...", flush=True)
            result = execute(run, min(a.timeout_per_run, left))
        s = summarize(run, result, a.measure_from, a.profile_step)
        if a.profile_step and s["status"] == "ok":
            trace = trace_of(run, work)
            data = read_trace(trace) if trace else None  # parsed once: an 8B trace is hundreds of MB
            s.update({f.__name__: f(data) if data else None for f in (timeline, kernels, collectives)})
            s["trace"] = str(trace) if trace else None
        if run.trainer != "torchtitan" and s["imbalance_curve"] and a.log_freq == 1:  # (every step's load)
            s["imbalance_windows"] = window_imbalance(work / "runs" / run.log.stem / "metrics.jsonl")
        results.append(s)
        with open(work / "results.jsonl", "a") as fh:
            fh.write(json.dumps({**s, "env": env}) + "\n")
        print(f"[side-by-side] {run.trainer} {run.row} {run.setting}: {s['status']}", flush=True)
    base = f", base commit {env['base_commit']}" if a.base else ""
    header = (
        f"{env['date']}, {env['gpus']} x {env['device']}, torch {env['torch']}, titanrush commit "
        f"{env['commit']}{base}, torchtitan {env['torchtitan']}; {a.steps} steps, figures over steps "
        f">= {a.measure_from}"
    )
    commands = "\n".join(f"- {r['trainer']} {r['row']} {r['setting']}: `{r['command']}`" for r in results)
    tables = table(results)
    if a.profile_step:
        tables += f"\n\nRank 0's step {a.profile_step} (ms, share of the step):\n\n{timeline_table(results)}"
        tables += f"\n\nThe kernels that differ most, ms per step (GEMMs by shape):{kernel_tables(results)}"
    (work / "results.md").write_text(f"{header}\n\n{tables}\n\nCommands:\n\n{commands}\n")
    print(f"\n{header}\n\n{tables}")
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
