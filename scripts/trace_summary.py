"""Where a profiled step's GPU time went, from a Chrome trace file (titanrush's or torchtitan's).

Usage: python scripts/trace_summary.py TRACE.json[.gz] [TRACE ...] [--top 20] [--gaps 0]

For each trace: kernel time per step by kind (the kinds of `titanrush.profiling.kind_of`), then the
timeline view that a per-kernel sum cannot give, from the union of kernel intervals over all streams:
- span: first kernel start to last kernel end, per step;
- compute busy: time some non-communication kernel runs;
- exposed communication: time a communication kernel runs while no compute kernel does (what
  overlapping collectives with compute did not hide);
- idle: time no kernel runs at all (launch gaps, host-side waits);
- with `--gaps N`: the N longest stretches without compute (idle or exposed communication), each with
  its place in the span and the compute kernels on either side, so a gap can be traced to its cause.
Both trainers write traces with torch.profiler's `export_chrome_trace`, so one reader fits both.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanrush.profiling import kind_of  # noqa: E402

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union `a` not covered by the union `b` (both sorted, disjoint)."""
    out, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out += e - cur
    return out


def summarize(trace: dict) -> dict:
    """Per-step figures in milliseconds (see the module docstring)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = {
        e["name"]
        for e in events
        if e.get("ph") == "X"
        and str(e.get("name", "")).startswith("ProfilerStep#")
        and "gpu" not in e.get("cat", "")  # the CPU-side step ranges, not their GPU shadows
    }
    n = max(len(steps), 1)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS and e.get("dur")]
    if not kernels:
        raise ValueError("no GPU kernels in this trace (was it recorded on a GPU?)")
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    comm, compute = [], []
    for e in kernels:
        kind = kind_of(e["name"]) if e["cat"] == "kernel" else "other"
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
        acc = by_name.setdefault(e["name"], [0.0, 0])
        acc[0] += e["dur"]
        acc[1] += 1
        (comm if kind == "communication" else compute).append((e["ts"], e["ts"] + e["dur"]))
    comm_u, compute_u = _union(comm), _union(compute)
    start = min(e["ts"] for e in kernels)
    busy = _length(_union(comm + compute))
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    ms = 1e-3 / n
    return {
        "steps": n,
        "span_ms": span * ms,
        "kernel_ms": sum(by_kind.values()) * ms,
        "by_kind_ms": {k: v * ms for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "compute_busy_ms": _length(compute_u) * ms,
        "communication_ms": _length(comm_u) * ms,
        "exposed_communication_ms": _minus(comm_u, compute_u) * ms,
        "idle_ms": (span - busy) * ms,
        "top": sorted(((v[0] * ms, v[1] / n, k) for k, v in by_name.items()), reverse=True),
        "gaps": _gaps(kernels, compute_u, comm_u, start),
    }


def _gaps(kernels: list[dict], compute_u: list, comm_u: list, start: float) -> list[dict]:
    """Every stretch between two compute intervals, longest first: where it sits (ms from the first
    kernel), how long it is, how much of it communication filled, and the compute kernels around it."""
    ends = sorted((e["ts"] + e["dur"], e["name"]) for e in kernels if kind_of(e["name"]) != "communication")
    starts = sorted((e["ts"], e["name"]) for e in kernels if kind_of(e["name"]) != "communication")
    out = []
    for (_, s), (e, _) in itertools.pairwise(compute_u):
        before = ends[bisect.bisect_right(ends, (s, chr(0x10FFFF))) - 1][1]
        after = starts[bisect.bisect_left(starts, (e, ""))][1]
        comm = _length([(max(a, s), min(b, e)) for a, b in comm_u if a < e and b > s])
        out.append({"at_ms": (s - start) / 1e3, "ms": (e - s) / 1e3, "comm_ms": comm / 1e3,
                    "before": before, "after": after})  # fmt: skip
    return sorted(out, key=lambda g: -g["ms"])


def render(name: str, s: dict, top: int, gaps: int = 0) -> str:
    lines = [f"== {name}: {s['steps']} step(s); per step:"]
    lines.append(f"  span {s['span_ms']:9.1f} ms   kernel time (all streams) {s['kernel_ms']:9.1f} ms")
    for k, v in s["by_kind_ms"].items():
        lines.append(f"    {k:<14} {v:9.1f} ms  {100 * v / s['kernel_ms']:5.1f}%")
    span = s["span_ms"] or 1.0
    for label, key in (
        ("compute busy", "compute_busy_ms"),
        ("communication (union)", "communication_ms"),
        ("exposed communication", "exposed_communication_ms"),
        ("idle (no kernel)", "idle_ms"),
    ):
        lines.append(f"  {label:<22} {s[key]:9.1f} ms  {100 * s[key] / span:5.1f}% of span")
    lines.append(f"  top {top} kernels (ms per step, calls per step):")
    for t, calls, kname in s["top"][:top]:
        lines.append(f"    {t:9.2f} {calls:7.1f}  {kind_of(kname):<14} {kname[:100]}")
    if gaps:
        lines.append(f"  {gaps} longest stretches without compute in the whole trace (at ms from the first "
                     "kernel; ms; ms of it communication):")  # fmt: skip
        for g in s["gaps"][:gaps]:
            lines.append(f"    at {g['at_ms']:8.1f}  {g['ms']:6.2f} ms  comm {g['comm_ms']:6.2f}  "
                         f"after {g['before'][:50]}  before {g['after'][:50]}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--gaps", type=int, default=0, help="list the N longest stretches without compute")
    a = ap.parse_args()
    for path in a.traces:
        if not path.is_file():
            print(f"error: no trace file {path}", file=sys.stderr)
            return 2
        print(render(str(path), summarize(load(path)), a.top, a.gaps))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
