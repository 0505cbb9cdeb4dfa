"""Auto's plan against torchtitan's, in the estimator (issue #50's 70B-class comparison).

For each scenario: the plan titanrush's planner picks for its auto levers (activation checkpointing,
ZeRO-2/3, the chunked loss), and the fastest of the settings torchtitan offers that fits the same GPU memory
with the same margin (`plan.margin`): activation checkpointing none, per-op (every other matmul output kept,
titanrush's `op_matmuls = "alternate"`) or full, under FSDP's default reshard and the plain loss. Each with
its estimated memory per GPU (`memory_fit`: peak + allocator slack + CUDA context) and step time (`plan_cost`:
the step's compute plus what the plan adds: recomputation, the second all-gather, the mesh's exposed
collectives); the ratio of the step times is auto's estimated speed-up. Both are titanrush's models of both
plans, so the ratio says what the choice of plan buys, not how the two trainers' kernels compare.

CPU only, no GPU: python scripts/bench/plan_vs_torchtitan.py [--gpu-mem 139.8]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from titanrush import config as cfgmod  # noqa: E402
from titanrush.config import split_args  # noqa: E402
from titanrush.run import autoplan  # noqa: E402

C8 = f"--config {ROOT}/train_configs/llama8b_fsdp.toml --training.loss auto"
C70 = f"--config {ROOT}/train_configs/llama70b_2d.toml --activation_checkpoint.mode auto --training.loss auto"
# (name, GPUs, run_train.sh arguments): the measured 8B rows first (auto_plan.md), then 70B-class meshes.
SCENARIOS = [
    ("8B, FSDP 2 (measured: 1.110x)", 2, C8),
    ("8B, FSDP 4", 4, C8),
    ("8B, FSDP 2 x TP 2", 4, f"{C8} --parallelism.tp 2 --training.loss plain"),
    ("8B, FSDP 2 x CP 2", 4, f"{C8} --parallelism.cp 2 --training.loss plain"),
    ("70B, FSDP 16, batch 2", 16, f"{C70} --parallelism.tp 1 --training.local_batch_size 2"),
    ("70B, FSDP 32, batch 2", 32, f"{C70} --parallelism.tp 1 --training.local_batch_size 2"),
    ("70B, FSDP 64, batch 2", 64, f"{C70} --parallelism.tp 1 --training.local_batch_size 2"),
    (
        "70B, FSDP 4 x TP 2 x CP 2, batch 8",
        16,
        f"{C70} --parallelism.tp 2 --parallelism.cp 2 --training.loss plain",
    ),
    ("70B, FSDP 8 x TP 8, batch 8", 64, f"{C70} --training.loss plain"),
    ("70B, FSDP 4 x TP 8 x CP 2, batch 8", 64, f"{C70} --parallelism.cp 2 --training.loss plain"),
]
TORCHTITAN_AC = {  # torchtitan's activation checkpointing, as titanrush's settings
    "none": {"mode": "none"},
    "per-op": {"mode": "selective", "selective": "op", "op_matmuls": "alternate", "op_all_last": 0},
    "full": {"mode": "full"},
}


def torchtitan_like(c: autoplan.Candidate) -> str | None:
    """The torchtitan setting a candidate is, or None (a titanrush-only lever)."""
    s = c.settings
    if s.get(autoplan.RESHARD, "default") != "default" or s.get(autoplan.LOSS, "plain") != "plain":
        return None
    ac = {k[len(autoplan.AC) :]: v for k, v in s.items() if k.startswith(autoplan.AC)}
    for name, want in TORCHTITAN_AC.items():
        if all(ac.get(k) == v for k, v in want.items()) and (
            want["mode"] != "selective" or ac.get("op_all_last") == 0
        ):
            return name
    return None


def compare(name: str, ngpu: int, args: str, gpu_mem: float) -> str:
    path, _, overrides = split_args(shlex.split(args))
    cfg = cfgmod.load(path, overrides)
    choice = autoplan.resolve(cfg, ngpu, gpu_mem, machine=False)
    limit = choice.limit
    auto = choice.chosen
    if auto is None or auto.total > limit:
        return f"| {name} | {ngpu} | nothing fits | | | |"
    tt = [(c, torchtitan_like(c)) for c in choice.ranked]
    fitting = [(c, label) for c, label in tt if label and c.total <= limit]
    step = lambda c: c.cost.compute_s + c.cost.extra_s  # noqa: E731
    auto_cell = f"{auto.label()}: {auto.gib:.1f} GiB, {step(auto):.2f} s"
    if not fitting:
        return f"| {name} | {ngpu} | {auto_cell} | none of torchtitan's fits | | |"
    best, label = fitting[0]  # (ranked cheapest first)
    shipped = next((c for c, lab in fitting if lab == "per-op"), None)  # its Llama 3 recipes' policy
    vs_shipped = f"{step(shipped) / step(auto):.3f}x" if shipped else "does not fit"
    tt_cell = f"AC {label}: {best.gib:.1f} GiB, {step(best):.2f} s"
    return (
        f"| {name} | {ngpu} | {auto_cell} | {tt_cell} | {vs_shipped} | **{step(best) / step(auto):.3f}x** |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu-mem", type=float, default=139.8, help="GiB per GPU (default: an H200's 139.8)")
    a = p.parse_args()
    print(f"GPU memory {a.gpu_mem} GiB per GPU; a plan must fit it less plan.margin (5%).\n")
    print(
        "| scenario | GPUs | auto's plan: memory, step | torchtitan's best that fits: memory, step "
        "| auto vs torchtitan per-op (shipped) | auto vs torchtitan's best |"
    )
    print("|---|---:|---|---|---:|---:|")
    for name, ngpu, args in SCENARIOS:
        print(compare(name, ngpu, args, a.gpu_mem), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
