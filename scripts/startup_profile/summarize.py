"""Where rank 0's time to first step goes, from py-spy's speedscope profile of its main thread.

    python scripts/startup_profile/summarize.py PROFILE.json [--step1-s S] [--top N]

The main thread's samples, in order, are cut into phases at the first sample inside the trainer's
constructor (`Trainer.__init__`, both trainers) and the first inside its training loop (`Trainer.train`):
imports before the set-up, the set-up, step 1 and the rest. Step 1 ends where the loss of step 1 has been
reduced for its log line (titanrush's `_global_mean`, torchtitan's `dist_mean`/`dist_sum`); with
`--step1-s`, after that many seconds of samples instead (py-spy falls behind on a busy host, so sample
time runs slow against the log's). Each phase's samples are then counted by
kind (import, dynamo, AOT autograd, inductor, waiting for compile workers, process groups, flash-attn,
other) and by the functions they pass through (inclusive seconds).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

# (kind, a test on one frame): a sample's kind is the first whose test matches any of its frames
KINDS = [
    ("import", lambda n, f: n == "_find_and_load"),
    ("compile workers (wait)", lambda n, f: "_inductor/async_compile" in f and "wait" in n),
    ("autotune", lambda n, f: "_inductor" in f and ("autotune" in n or "benchmark" in n)),
    ("inductor", lambda n, f: "torch/_inductor/" in f),
    ("aot autograd", lambda n, f: "torch/_functorch/" in f),
    ("dynamo", lambda n, f: "torch/_dynamo/" in f),
    ("flash-attn", lambda n, f: "flash_attn" in f or "cutlass" in f),
    ("process group", lambda n, f: "distributed_c10d" in f or "device_mesh" in f),
]
LOSS_REDUCED = {"Trainer._global_mean", "dist_mean", "dist_sum"}  # step 1's log line is next


def main_thread(profile: dict) -> tuple[list[list[tuple[str, str]]], list[float]]:
    """The samples (root-first stacks of (name, file)) and weights of the thread that ran the module."""
    frames = [(f["name"], f.get("file") or "") for f in profile["shared"]["frames"]]
    best = max(
        profile["profiles"],
        key=lambda p: sum(any(frames[i][0] == "_run_module_as_main" for i in s) for s in p["samples"]),
    )
    return [[frames[i] for i in s] for s in best["samples"]], best["weights"]


def kind_of(stack: list[tuple[str, str]]) -> str:
    for kind, test in KINDS:
        if any(test(n, f) for n, f in stack):
            return kind
    return "other"


def first_index(stacks: list, name: str, start: int = 0) -> int | None:
    for i in range(start, len(stacks)):
        if any(n == name for n, _ in stacks[i]):
            return i
    return None


def phases(stacks: list, weights: list[float], step1_s: float | None) -> list[tuple[str, int, int]]:
    """(phase, first sample, end sample) for imports, set-up, step 1 and the rest."""
    n = len(stacks)
    init = first_index(stacks, "Trainer.__init__")
    train = first_index(stacks, "Trainer.train", init or 0)
    init = n if init is None else init
    train = n if train is None else train
    if step1_s is not None:
        end, acc = train, 0.0
        while end < n and acc < step1_s:
            acc += weights[end]
            end += 1
    else:
        end = train
        while end < n and not any(name in LOSS_REDUCED for name, _ in stacks[end]):
            end += 1
        while end < n and any(name in LOSS_REDUCED for name, _ in stacks[end]):
            end += 1
    return [("imports", 0, init), ("set-up", init, train), ("step 1", train, end), ("after step 1", end, n)]


def short(name: str, file: str) -> str:
    parts = Path(file).parts
    return f"{name} ({'/'.join(parts[-2:]) if parts else '?'})"


def summarize(path: Path, step1_s: float | None, top: int) -> str:
    stacks, weights = main_thread(json.loads(path.read_text()))
    lines = [f"# {path.name}: main thread, {sum(weights):.1f} s sampled"]
    for phase, a, b in phases(stacks, weights, step1_s):
        total = sum(weights[a:b])
        lines.append(f"\n## {phase}: {total:.2f} s")
        kinds: collections.Counter = collections.Counter()
        inclusive: collections.Counter = collections.Counter()
        for i in range(a, b):
            kinds[kind_of(stacks[i])] += weights[i]
            for key in {short(n, f) for n, f in stacks[i]}:
                inclusive[key] += weights[i]
        lines.append("kinds: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.most_common()))
        for key, v in inclusive.most_common(top):
            lines.append(f"  {v:7.2f}  {key}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path, nargs="+")
    ap.add_argument("--step1-s", type=float, default=None, help="step 1's duration from the trainer's log")
    ap.add_argument("--top", type=int, default=40, help="functions listed per phase")
    a = ap.parse_args()
    for path in a.profile:
        print(summarize(path, a.step1_s, a.top))


if __name__ == "__main__":
    main()
