"""Reading torch.profiler traces offline: where a GPU's time went, kernel by kernel and collective by
collective, and two runs side by side (docs/profiling.md).

Any torch.profiler Chrome trace works: the `<run>/profile/step-<N>/rank<R>.trace.json.gz` that
`titanrush.profiling.Profiler` writes, or torchtitan's `rank<R>_trace.json`. `timeline` splits the recorded
steps into compute, exposed communication, copies and idle; `kernels` and `collectives` list what ran;
`kernel_table`, `collective_table` and `comparison` set two runs side by side
(`scripts/bench/side_by_side.py`). Kinds of work are the runtime profiler's (`kind_of`).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

from titanrush.profiling import kind_of

# -- The timeline of a trace file: compute, exposed communication, idle ----------------------------------

_COMM = (
    "nccl",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "reducescatter",
    "all_reduce",
    "allreduce",
    "all_to_all",
    "alltoall",
    "sendrecv",
    "c10d",
)
_COPY = ("memcpy", "memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the disjoint sorted intervals `a` that no interval of `b` (disjoint, sorted) covers."""
    out: list[tuple[float, float]] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _window(trace: dict[str, Any] | list[dict[str, Any]]) -> tuple[list, list, list, int]:
    """A trace's events, its GPU kernels (copies and sets included), the recorded steps' span on the GPU
    and the number of steps (at least 1). The span: per step, first start to last end of the kernels the
    host launched inside the step's range (`_launched`); for traces without launch records, the GPU's
    `ProfilerStep#N` ranges; without those, first kernel start to last kernel end."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    device = ("kernel", "gpu_memcpy", "gpu_memset")
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in device]
    if not kernels:
        raise ValueError("the trace has no GPU kernels (a CPU run, or not a torch.profiler trace)")
    if launched := _launched(events, kernels):
        return events, kernels, _union(launched), len(launched)
    steps = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "gpu_user_annotation"
        and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    if steps:
        span = _union([_ends(e) for e in steps])
    else:
        first = min(float(e["ts"]) for e in kernels)
        span = [(first, max(_ends(e)[1] for e in kernels))]
    return events, kernels, span, max(1, len(steps))


def _launched(events: list[dict[str, Any]], kernels: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per recorded step (a `ProfilerStep#N` range on the host), first start to last end of the kernels the
    host launched inside it (CUDA runtime calls matched to kernels by correlation id); [] where the trace
    lacks either. (The GPU's own `ProfilerStep#N` ranges end where a nested range such as the optimizer's
    `Optimizer.step` begins its kernels, and so leave out a step's last kernels.)"""

    host = [
        _ends(e)
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    runtime = ("cuda_runtime", "cuda_driver")
    calls = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in runtime and "correlation" in e.get("args", {})
    }
    out = []
    for lo, hi in sorted(host):
        mine = [_ends(k) for k in kernels if lo <= calls.get(k.get("args", {}).get("correlation"), -1) <= hi]
        if mine:
            out.append((min(a for a, _ in mine), max(b for _, b in mine)))
    return out


def timeline(trace: dict[str, Any]) -> dict[str, float]:
    """Where a GPU's time went in a Chrome trace (torch.profiler's `export_chrome_trace`, either trainer's).

    Over the recorded steps' windows on the GPU (`_window`: per step, the span of the kernels the host
    launched inside its `ProfilerStep#N` range), per step, in milliseconds:
    `compute` (time some compute kernel runs: everything but communication and copies), `comm` (time some
    communication kernel runs), `exposed_comm` (communication while no compute kernel runs: what the
    step waits for), `copy` (memory copies and sets while nothing else runs), `idle` (no kernel at all:
    the host is late), with `step` their sum, and `steps`. Kernels on several streams overlap, so each
    figure is a union of intervals, not a sum of kernel times. Then the compute kernels' summed time by
    kind (`kind_of`): `kernel_matmul`, `kernel_attention`, `kernel_compiled` (Triton), `kernel_optimizer`
    and `kernel_other`, which say where a difference in `compute` between two runs comes from.
    """
    _, kernels, span, n = _window(trace)

    def clip(sel: list[dict[str, Any]]) -> list[tuple[float, float]]:
        return _intersect(_union([_ends(e) for e in sel]), span)

    communicating, copying, computing = _sort(kernels)
    comm, copy, compute = clip(communicating), clip(copying), clip(computing)
    kinds = dict.fromkeys(("matmul", "attention", "compiled", "optimizer", "other"), 0.0)
    for e in computing:
        kind, start = kind_of(str(e.get("name", ""))), float(e["ts"])
        inside = _length(_intersect([(start, start + float(e["dur"]))], span))
        kinds[kind if kind in kinds else "other"] += inside
    busy = _union(compute + comm + copy)
    total = _length(span)
    exposed = _minus(comm, compute)
    copy_only = _minus(_minus(copy, compute), comm)
    return {
        "steps": float(n),
        "step": total / n / 1e3,
        "compute": _length(compute) / n / 1e3,
        "comm": _length(comm) / n / 1e3,
        "exposed_comm": _length(exposed) / n / 1e3,
        "copy": _length(copy_only) / n / 1e3,
        "idle": (total - _length(busy)) / n / 1e3,
        **{f"kernel_{kind}": t / n / 1e3 for kind, t in kinds.items()},
    }


def _ends(e: dict[str, Any]) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _sort(kernels: list[dict[str, Any]]) -> tuple[list, list, list]:
    """A trace's GPU kernels as (communication, copies and sets, compute)."""
    out: tuple[list, list, list] = ([], [], [])
    for e in kernels:
        name = str(e.get("name", "")).lower()
        comm = any(k in name for k in _COMM)
        out[0 if comm else 1 if e.get("cat") != "kernel" or any(k in name for k in _COPY) else 2].append(e)
    return out


def collectives(trace: dict[str, Any] | list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The communication kernels of a trace's recorded steps (as `timeline` finds them), per step, keyed by
    kernel (`_kernel_key`: collective, reduction, dtype, algorithm) and message size where the trace
    records it (torch.profiler's `In msg nelems`; process groups are named differently by each trainer):
    `calls`; `ms`, their time; `exposed`, the part no compute kernel overlaps (what the step waits for);
    `concurrent`, the part another stream's communication overlaps (sharing links and SMs). Two runs with
    the same collectives and different `ms` wait differently: for a peer, or for bandwidth."""
    _, found, span, n = _window(trace)
    comm, _, computing = _sort(found)
    compute = _union([_ends(e) for e in computing])
    streams: dict[Any, list[tuple[float, float]]] = {}
    for e in comm:
        streams.setdefault(e.get("tid"), []).append(_ends(e))
    others = {s: _union([iv for t, ivs in streams.items() if t != s for iv in ivs]) for s in streams}
    out: dict[str, dict[str, float]] = {}
    for e in comm:
        inside = _intersect([_ends(e)], span)
        if not inside:
            continue
        size = e.get("args", {}).get("In msg nelems")
        key = _kernel_key(str(e.get("name", ""))) + (f" ({size} elements)" if size is not None else "")
        row = out.setdefault(key, dict.fromkeys(("calls", "ms", "exposed", "concurrent"), 0.0))
        row["calls"] += 1 / n
        row["ms"] += _length(inside) / n / 1e3
        row["exposed"] += _length(_minus(inside, compute)) / n / 1e3
        row["concurrent"] += _length(_intersect(inside, others[e.get("tid")])) / n / 1e3
    return out


def collective_table(a: dict, b: dict, names: tuple[str, str] = ("a", "b")) -> str:
    """Two `collectives` results side by side, the longest first: per step calls, ms, exposed, concurrent."""
    keys = sorted(a.keys() | b.keys(), key=lambda k: -max(x.get(k, {}).get("ms", 0.0) for x in (a, b)))
    head = f"| collective | {names[0]}: calls, ms, exposed, concurrent | {names[1]} |\n|---|---|---|"

    def cells(row: dict | None) -> str:
        return "-" if row is None else "{calls:.0f}, {ms:.1f}, {exposed:.1f}, {concurrent:.1f}".format(**row)

    return "\n".join([head, *(f"| `{k}` | {cells(a.get(k))} | {cells(b.get(k))} |" for k in keys)])


def trace_timeline(path: Path | str) -> dict[str, float]:
    """`timeline` of a trace file (`.json`, or `.json.gz` as titanrush writes them)."""
    return timeline(read_trace(path))


def read_trace(path: Path | str) -> Any:
    """A Chrome trace file, `.json` or `.json.gz`, parsed (for `timeline` and `kernels` of one read)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time both disjoint sorted interval lists cover."""
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


_MATMUL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::_scaled_mm",
    "aten::_grouped_mm",
)


def kernels(trace: dict[str, Any] | list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """The compute kernels of a trace's recorded steps (as `timeline` finds them), per step: key -> (calls,
    ms). A matmul kernel's key is the op that launched it and its input shapes (`aten::mm 16384x4096 @
    4096x14336`, torch.profiler's `record_shapes`; both trainers record them), so that two runs' GEMMs
    compare shape by shape; any other kernel's key is its name (`_kernel_key`). Communication kernels and
    copies are left out (`timeline` accounts for them)."""
    events, found, span, n = _window(trace)
    ops: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and str(e.get("name", "")) in _MATMUL_OPS:
            ops.setdefault(e.get("args", {}).get("External id"), []).append(e)
    out: dict[str, tuple[float, float]] = {}
    for e in _sort(found)[2]:  # the compute kernels
        name = str(e.get("name", ""))
        start = float(e["ts"])
        inside = _length(_intersect([(start, start + float(e["dur"]))], span))
        if not inside:
            continue
        key = _kernel_key(name)
        launcher = ops.get(e.get("args", {}).get("External id"))
        if kind_of(name) == "matmul" and launcher:
            op = min(launcher, key=lambda o: float(o.get("dur", 0)))  # the innermost matmul op
            dims = [d for d in op.get("args", {}).get("Input Dims", []) if isinstance(d, list) and d]
            key = f"{op['name']} " + " @ ".join("x".join(map(str, d)) for d in dims[:2])
        calls, ms = out.get(key, (0.0, 0.0))
        out[key] = (calls + 1 / n, ms + inside / n / 1e3)
    return out


def _kernel_key(name: str) -> str:
    """A kernel's name without namespaces and argument list; a Triton kernel's without the index inductor
    numbers it by (`triton_poi_fused_mul_silu_7`), which differs between compilations of the same code."""
    name = re.sub(r"\(anonymous namespace\)::|\b[a-z_]+::", "", name).split("(")[0]  # namespaces out
    return (re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name)[:120]


def kernel_differences(
    a: dict[str, tuple[float, float]], b: dict[str, tuple[float, float]], top: int = 10
) -> list[tuple[str, float, float, float, float]]:
    """The `top` kernel keys whose time per step differs most between two `kernels` results (largest
    absolute difference first): (key, calls in a, ms in a, calls in b, ms in b), zeros where one lacks it."""
    keys = sorted(a.keys() | b.keys(), key=lambda k: -abs(a.get(k, (0, 0))[1] - b.get(k, (0, 0))[1]))
    return [(k, *a.get(k, (0.0, 0.0)), *b.get(k, (0.0, 0.0))) for k in keys[:top]]


def kernel_table(a: dict, b: dict, names: tuple[str, str] = ("a", "b"), top: int = 8) -> str:
    """`kernel_differences` as a markdown table: ms per step and calls per step of each run."""
    head = f"| kernel | {names[0]} ms | calls | {names[1]} ms | calls |\n|---|---:|---:|---:|---:|"
    rows = [
        f"| `{k}` | {am:.1f} | {ac:.0f} | {bm:.1f} | {bc:.0f} |"
        for k, ac, am, bc, bm in kernel_differences(a, b, top)
    ]
    return "\n".join([head, *rows])


def comparison(a: dict, b: dict, names: tuple[str, str] = ("a", "b"), top: int = 8) -> str:
    """Two profiled runs side by side, each a dict with their `kernels` and `collectives`: the `top`
    kernels whose time differs most (`kernel_table`), then every collective (`collective_table`)."""
    kernel_part = kernel_table(a["kernels"], b["kernels"], names, top)
    both = collective_table(a.get("collectives") or {}, b.get("collectives") or {}, names)
    return f"{kernel_part}\n\nCollectives, per step:\n\n{both}"
