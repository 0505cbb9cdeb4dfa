"""Where the peak of a CUDA memory snapshot comes from: the allocated peak, and what was live at it, by code.

Usage (anywhere; needs no torch and no GPU):
  python scripts/memory_peak.py SNAPSHOT.pickle [--device D] [--top 25] [--json OUT] [--max-entries 100000]

SNAPSHOT is a pickle written by `torch.cuda.memory._dump_snapshot(path)` after
`torch.cuda.memory._record_memory_history(max_entries=...)`, e.g. titanrush's
`<run>/memory_snapshot/step-<N>-rank<R>.pickle` (`profiling.memory_snapshot`).

Method (the same accounting as torch's memory viewer, torch/utils/viz/MemoryViz.js, `simulate_memory`):

1. The state at the dump comes from `segments` (of the chosen device): the live blocks are those in state
   `active_allocated` or `active_pending_free` (freed by the program, but still in use by a stream, so
   still allocated), each counted at its requested size (the trace's sizes are requested sizes too);
   reserved = the sum of the segments' `total_size`.
2. `device_traces[D]` is the allocator's event log up to the dump, oldest first. Walking it backwards undoes
   each event: an `alloc` removes its block; a `free_completed` puts it back, with the frames of its
   matching earlier `alloc` when that is in the trace, else the free event's own frames (the allocator
   records the free context there, or the allocation's when none); `free_requested` changes nothing, as a
   block counts as allocated until its free completes; `segment_alloc`/`segment_map` take their size off
   reserved, `segment_free`/`segment_unmap` add it back; `oom` and `snapshot` change nothing. This gives
   the allocated and reserved bytes at every point of the window (point k = after the first k events;
   point 0 = the window start, the last point = the dump), and the live set at the peak point.
3. The blocks live at the peak are grouped by allocation site: the innermost frame (frames are listed
   innermost first, as in a Python traceback read bottom-up) whose file is under titanrush/,
   torch/distributed/, torch/optim/, torch/utils/checkpoint, torch/_functorch or torchao/, shown as
   "path/from/package.py:function". Blocks without any Python frame (autograd's backward thread,
   allocations made before recording started) are "<no python frame>"; Python stacks that touch none of
   those packages are "<other python code>".

The peak is the peak within the recorded window: the trace is a ring buffer of `max_entries` events, so
when it is full, older events were dropped and an earlier, higher peak cannot be excluded; likewise when
the peak is the window's first point. The allocated figures are requested bytes, as the viewer shows;
`torch.cuda.memory_allocated()` counts the allocator's rounded block sizes, a little more (both are
printed at the dump).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
DEFAULT_MAX_ENTRIES = 100_000  # what titanrush's profiler records with (titanrush/profiling.py)

# A frame is ours to name when its file is under one of these (the rightmost match in its path).
PACKAGE_MARKERS = (
    "titanrush/",
    "torch/distributed/",
    "torch/optim/",
    "torch/utils/checkpoint",
    "torch/_functorch",
    "torchao/",
)
NO_PYTHON = "<no python frame>"
OTHER_PYTHON = "<other python code>"
# 'active_awaiting_free' is how torch.cuda.memory._snapshot's docstring spells 'active_pending_free'.
ALLOCATED_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")

Frame = dict[str, Any]
Event = dict[str, Any]
Snapshot = dict[str, Any]


@dataclass
class Block:
    """A live allocation: its requested size and the stack it was allocated from."""

    size: int
    frames: list[Frame]


# ---------------------------------------------------------------------------------------------------------
# Loading


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots are plain dicts, lists, strings and numbers: refuse anything else (runs no code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a memory snapshot")


def load_snapshot(path: str | Path) -> Snapshot:
    with open(path, "rb") as f:
        data = _PlainUnpickler(f).load()
    if not isinstance(data, dict) or "segments" not in data:
        raise ValueError(f"{path}: not a CUDA memory snapshot (no 'segments')")
    return data


# ---------------------------------------------------------------------------------------------------------
# Categories


def _package_path(filename: str) -> str:
    """The path from the installation root on, so a venv inside a titanrush checkout is not 'titanrush/'."""
    path = filename.replace("\\", "/")
    for root in ("site-packages/", "dist-packages/"):
        k = path.rfind(root)
        if k >= 0:
            return path[k + len(root) :]
    return path


def frame_label(frame: Frame) -> str | None:
    """'titanrush/models/llama.py:forward' for a frame in one of PACKAGE_MARKERS, else None."""
    path = _package_path(str(frame.get("filename", "")))
    start = max(path.rfind(marker) for marker in PACKAGE_MARKERS)
    if start < 0:
        return None
    return f"{path[start:]}:{frame.get('name', '?')}"


def category(frames: Sequence[Frame]) -> str:
    """The allocation site of a block: its innermost frame in one of our packages."""
    for frame in frames:  # innermost first
        label = frame_label(frame)
        if label is not None:
            return label
    if any(str(f.get("filename", "")).endswith(".py") for f in frames):
        return OTHER_PYTHON
    return NO_PYTHON


def group_by_category(blocks: dict[int, Block], total: int, top: int) -> list[dict[str, Any]]:
    """Rows {category, bytes, count, share}, largest first: the top `top`, then one 'other' row."""
    groups: dict[str, list[int]] = {}
    for block in blocks.values():
        g = groups.setdefault(category(block.frames), [0, 0])
        g[0] += block.size
        g[1] += 1
    ordered = sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))

    def row(name: str, nbytes: int, count: int) -> dict[str, Any]:
        return {"category": name, "bytes": nbytes, "count": count, "share": nbytes / total if total else 0.0}

    rows = [row(name, b, c) for name, (b, c) in ordered[:top]]
    rest = ordered[top:]
    if rest:
        rows.append(
            row(
                f"other ({len(rest)} categories)",
                sum(b for _, (b, _c) in rest),
                sum(c for _, (_b, c) in rest),
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------------------
# The state at the dump


def device_segments(snapshot: Snapshot, device: int) -> list[dict[str, Any]]:
    return [s for s in snapshot["segments"] if s.get("device", 0) == device]


def _segment_blocks(segment: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(address, block) pairs; old snapshots lack the block address, which follows from the sizes."""
    out, addr = [], segment["address"]
    for b in segment.get("blocks", []):
        out.append((b.get("address", addr), b))
        addr += b["size"]
    return out


def _requested(block: dict[str, Any]) -> int:
    return block.get("requested_size", block["size"])


def _blocks_at_dump(snapshot: Snapshot, device: int, states: Iterable[str]) -> Iterator[tuple[int, dict]]:
    """(address, block) of the device's blocks at the dump whose state is one of `states`."""
    for seg in device_segments(snapshot, device):
        for addr, b in _segment_blocks(seg):
            if b["state"] in states:
                yield addr, b


def live_at_dump(snapshot: Snapshot, device: int) -> dict[int, Block]:
    return {
        addr: Block(_requested(b), list(b.get("frames", [])))
        for addr, b in _blocks_at_dump(snapshot, device, ALLOCATED_STATES)
    }


def rounded_allocated_at_dump(snapshot: Snapshot, device: int) -> int:
    """What torch.cuda.memory_allocated() would say: the allocator's block sizes, not the requested ones."""
    return sum(b["size"] for _, b in _blocks_at_dump(snapshot, device, ALLOCATED_STATES))


def reserved_at_dump(snapshot: Snapshot, device: int) -> int:
    return sum(seg["total_size"] for seg in device_segments(snapshot, device))


def inactive_block_sizes(snapshot: Snapshot, device: int) -> list[int]:
    """Sizes of the free-but-reserved blocks at the dump, largest first (a fragmentation hint)."""
    return sorted((b["size"] for _, b in _blocks_at_dump(snapshot, device, ("inactive",))), reverse=True)


def pick_device(snapshot: Snapshot) -> int:
    """The device with the most reserved memory at the dump (a rank's snapshot holds its own device)."""
    reserved: dict[int, int] = {}
    for seg in snapshot["segments"]:
        d = seg.get("device", 0)
        reserved[d] = reserved.get(d, 0) + seg["total_size"]
    if reserved:
        return max(reserved, key=lambda d: (reserved[d], -d))
    traces = snapshot.get("device_traces", [])
    return next((d for d, t in enumerate(traces) if t), 0)


# ---------------------------------------------------------------------------------------------------------
# Walking the trace backwards


def alloc_frames_of_frees(trace: Sequence[Event]) -> dict[int, list[Frame]]:
    """For each free_completed (by index) whose alloc is in the trace: that alloc's frames."""
    open_allocs: dict[int, list[Frame]] = {}
    out = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            open_allocs[e["addr"]] = e.get("frames", [])
        elif e["action"] == "free_completed" and e["addr"] in open_allocs:
            out[i] = open_allocs.pop(e["addr"])
    return out


class Rewind:
    """The allocator's state, moved from the dump back to earlier points by undoing events."""

    def __init__(
        self,
        trace: Sequence[Event],
        live: dict[int, Block],
        reserved: int,
        alloc_frames: dict[int, list[Frame]] | None = None,  # alloc_frames_of_frees(trace), if known
    ) -> None:
        self.trace = trace
        self.alloc_frames = alloc_frames_of_frees(trace) if alloc_frames is None else alloc_frames
        self.live = dict(live)
        self.allocated = sum(b.size for b in live.values())
        self.reserved = reserved
        self.point = len(trace)  # after the first `point` events
        self.inconsistent = 0  # events that do not fit the state (a snapshot from another run, a bug)

    def step_back(self) -> None:
        """Undo event `point - 1`."""
        self.point -= 1
        i = self.point
        e = self.trace[i]
        action = e["action"]
        if action == "alloc":
            block = self.live.pop(e["addr"], None)
            if block is None:
                self.inconsistent += 1
            else:
                self.allocated -= block.size
        elif action == "free_completed":
            old = self.live.get(e["addr"])
            if old is not None:
                self.inconsistent += 1
                self.allocated -= old.size
            frames = self.alloc_frames.get(i, e.get("frames", []))
            self.live[e["addr"]] = Block(e["size"], list(frames))
            self.allocated += e["size"]
        elif action in ("segment_alloc", "segment_map"):
            self.reserved -= e["size"]
        elif action in ("segment_free", "segment_unmap"):
            self.reserved += e["size"]
        # free_requested, oom, snapshot: no change to allocated or reserved

    def rewind_to(self, point: int) -> None:
        while self.point > point:
            self.step_back()


@dataclass
class Timeline:
    """Allocated and reserved bytes at every point 0..len(trace) (point k = after the first k events)."""

    allocated: list[int]
    reserved: list[int]
    inconsistent: int


def timeline(
    trace: Sequence[Event],
    live: dict[int, Block],
    reserved: int,
    alloc_frames: dict[int, list[Frame]] | None = None,
) -> Timeline:
    r = Rewind(trace, live, reserved, alloc_frames)
    allocated, reserved_at = [r.allocated], [r.reserved]
    while r.point > 0:
        r.step_back()
        allocated.append(r.allocated)
        reserved_at.append(r.reserved)
    return Timeline(allocated[::-1], reserved_at[::-1], r.inconsistent)


# ---------------------------------------------------------------------------------------------------------
# The report


def analyze(
    snapshot: Snapshot,
    device: int | None = None,
    top: int = 25,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> dict[str, Any]:
    """All the figures, as one JSON-able dict (sizes in bytes)."""
    if device is None:
        device = pick_device(snapshot)
    traces = snapshot.get("device_traces", [])
    trace: list[Event] = traces[device] if device < len(traces) else []
    live = live_at_dump(snapshot, device)
    reserved = reserved_at_dump(snapshot, device)

    frames = alloc_frames_of_frees(trace)
    tl = timeline(trace, live, reserved, frames)
    allocated_at, reserved_at = tl.allocated, tl.reserved
    peak_point = max(range(len(allocated_at)), key=lambda k: (allocated_at[k], -k))  # the first of equals
    rewind = Rewind(trace, live, reserved, frames)  # a second walk: a rewind cannot step forward again
    rewind.rewind_to(peak_point)
    peak_live = rewind.live
    peak = allocated_at[peak_point]

    n = len(trace)
    hit_max_entries = n >= max_entries
    peak_at_window_start = peak_point == 0 and n > 0
    inactive = inactive_block_sizes(snapshot, device)
    allocated_dump = allocated_at[-1]
    report: dict[str, Any] = {
        "device": device,
        "trace_events": n,
        "max_entries": max_entries,
        "peak_allocated_bytes": peak,
        "peak_allocated_gib": peak / GIB,
        "peak_reserved_bytes": reserved_at[peak_point],
        "peak_slack_bytes": reserved_at[peak_point] - peak,
        # the peak is the state after the first `peak_point` events, i.e. right after event peak_point - 1
        "peak_point": peak_point,
        "peak_event_index": peak_point - 1 if peak_point > 0 else None,
        "peak_event": _describe_event(trace[peak_point - 1]) if peak_point > 0 else None,
        "peak_live_blocks": len(peak_live),
        "peak_categories": group_by_category(peak_live, peak, top),
        "window_start_allocated_bytes": allocated_at[0],
        "window_start_reserved_bytes": reserved_at[0],
        "window_max_reserved_bytes": max(reserved_at),
        "dump_allocated_bytes": allocated_dump,
        "dump_allocated_rounded_bytes": rounded_allocated_at_dump(snapshot, device),
        "dump_reserved_bytes": reserved,
        "dump_slack_bytes": reserved - allocated_dump,
        "dump_inactive_blocks": len(inactive),
        "dump_inactive_bytes": sum(inactive),
        "dump_largest_inactive_bytes": inactive[:5],
        "hit_max_entries": hit_max_entries,
        "peak_at_window_start": peak_at_window_start,
        "window_may_be_truncated": hit_max_entries or peak_at_window_start,
        "oom_events": sum(1 for e in trace if e["action"] == "oom"),
        "inconsistent_events": tl.inconsistent,
    }
    report.update(_times(trace, peak_point))
    return report


def _describe_event(e: Event) -> dict[str, Any]:
    return {"action": e["action"], "bytes": e.get("size", 0), "category": category(e.get("frames", []))}


def _times(trace: Sequence[Event], peak_point: int) -> dict[str, Any]:
    """Seconds the window spans and from the peak to the last event, when events carry time_us (epoch us)."""
    if not trace or "time_us" not in trace[0] or "time_us" not in trace[-1]:
        return {}
    first, last = trace[0]["time_us"], trace[-1]["time_us"]
    out = {"window_seconds": (last - first) / 1e6}
    if peak_point > 0 and "time_us" in trace[peak_point - 1]:
        out["peak_seconds_before_last_event"] = (last - trace[peak_point - 1]["time_us"]) / 1e6
    return out


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.3f} GiB"


def _notes(r: dict[str, Any]) -> list[str]:
    notes = []
    if r["hit_max_entries"]:
        notes.append(
            f"the trace holds max_entries={r['max_entries']} events: the ring buffer wrapped and older "
            "events were dropped, so an earlier, higher peak cannot be excluded"
        )
    if r["peak_at_window_start"]:
        notes.append("the peak is the window's first point: memory may have been higher before the window")
    if r["trace_events"] == 0:
        notes.append("no trace events for this device: the 'peak' is the dump (was history recorded?)")
    if r["inconsistent_events"]:
        notes.append(
            f"{r['inconsistent_events']} trace events do not fit the segments' state (alloc of a block not "
            "live, or free of one already live): the figures may be off"
        )
    if r["oom_events"]:
        notes.append(f"{r['oom_events']} OOM events in the window")
    return notes


def format_report(r: dict[str, Any], source: str = "") -> str:
    n = r["trace_events"]
    lines = [
        f"{source or 'snapshot'}: device {r['device']}, {n} trace events (max_entries {r['max_entries']})"
    ]
    if n == 0:
        where = "at the dump (no trace events)"
    elif r["peak_point"] == 0:
        where = "at the window start, before event 0"
    else:
        where = f"right after event {r['peak_event_index']} (of 0..{n - 1})"
        where += ", the dump state" if r["peak_point"] == n else ""
    if "peak_seconds_before_last_event" in r:
        where += f", {r['peak_seconds_before_last_event']:.2f} s before the last event"
    lines.append(
        f"peak allocated {_gib(r['peak_allocated_bytes'])}, peak within the recorded window, {where}"
    )
    if r["peak_event"]:
        e = r["peak_event"]
        lines.append(f"  reached by: {e['action']} of {_gib(e['bytes'])} from {e['category']}")
    lines.append(
        f"  reserved at the peak {_gib(r['peak_reserved_bytes'])}; "
        f"allocator slack (reserved - allocated) {_gib(r['peak_slack_bytes'])}"
    )
    lines.append(
        f"window start: allocated {_gib(r['window_start_allocated_bytes'])}, "
        f"reserved {_gib(r['window_start_reserved_bytes'])}; "
        f"most reserved in the window {_gib(r['window_max_reserved_bytes'])}"
    )
    lines.append(
        f"at the dump: allocated {_gib(r['dump_allocated_bytes'])} (block sizes "
        f"{_gib(r['dump_allocated_rounded_bytes'])}), reserved {_gib(r['dump_reserved_bytes'])}, "
        f"slack {_gib(r['dump_slack_bytes'])}"
    )
    largest = ", ".join(f"{b / GIB:.3f}" for b in r["dump_largest_inactive_bytes"]) or "-"
    lines.append(
        f"  inactive (free but reserved) blocks: {r['dump_inactive_blocks']}, "
        f"{_gib(r['dump_inactive_bytes'])}; largest: {largest} GiB"
    )
    lines += [f"NOTE: {note}" for note in _notes(r)]
    lines += ["", f"live at the peak by allocation site ({r['peak_live_blocks']} blocks):"]
    width = max([len("category")] + [len(row["category"]) for row in r["peak_categories"]])
    lines.append(f"  {'category':<{width}}  {'GiB':>9}  {'count':>7}  {'share':>6}")
    for row in r["peak_categories"]:
        name, gib = row["category"], row["bytes"] / GIB
        lines.append(f"  {name:<{width}}  {gib:>9.3f}  {row['count']:>7}  {row['share']:>6.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", help="pickle from torch.cuda.memory._dump_snapshot")
    p.add_argument(
        "--device", type=int, default=None, help="CUDA device (default: the one with most reserved)"
    )
    p.add_argument("--top", type=int, default=25, help="categories to list before 'other' (default 25)")
    p.add_argument("--json", metavar="OUT", help="also write the figures as one JSON object to OUT")
    p.add_argument(
        "--max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help=f"max_entries the history was recorded with (default {DEFAULT_MAX_ENTRIES})",
    )
    args = p.parse_args(argv)
    report = analyze(load_snapshot(args.snapshot), args.device, args.top, args.max_entries)
    print(format_report(report, args.snapshot))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
