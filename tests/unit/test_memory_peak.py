"""scripts/memory_peak.py on a hand-built snapshot: the peak mid-trace, its live set, the reserved figures."""

from __future__ import annotations

import json
import pickle
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import memory_peak as mp  # noqa: E402

MiB = 1 << 20
SEG_A, SEG_B, SEG_C = 0x10000000, 0x20000000, 0x30000000
PARAM, OLD, CKPT = SEG_A, SEG_A + 4 * MiB, SEG_A + 5 * MiB  # blocks in segment A
OPT = SEG_B
ACT, GRAD = SEG_C, SEG_C + 8 * MiB


def frame(filename: str, name: str, line: int = 1) -> dict:
    return {"filename": filename, "line": line, "name": name}


# innermost first, as torch records them
INIT = [frame("/home/u/titanrush/titanrush/models/llama.py", "init_weights"), frame("train.py", "main")]
OPTIM = [
    frame("/venv/lib/python3.11/site-packages/torch/optim/adamw.py", "_init_group"),
    frame("/home/u/titanrush/titanrush/train.py", "train_step"),
]
FWD = [
    frame("/venv/lib/python3.11/site-packages/torch/nn/functional.py", "linear"),
    frame("/home/u/titanrush/titanrush/models/llama.py", "forward"),
    frame("/home/u/titanrush/titanrush/train.py", "train_step"),
]
RECOMPUTE = [
    frame("/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "forward"),
    frame("/venv/lib/python3.11/site-packages/torch/utils/checkpoint.py", "unpack_hook"),
    frame("/home/u/titanrush/titanrush/train.py", "train_step"),
]
BACKWARD_FREE = [frame("/home/u/titanrush/titanrush/train.py", "backward_step")]
LOADER = [frame("/home/u/titanrush/titanrush/data/loader.py", "prefetch")]


def ev(action: str, addr: int, size: int, frames: list | None = None, **kw) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames or [], **kw}


def trace() -> list[dict]:
    """Allocated (MiB) after each event in the comments; before the window: PARAM 4 + OLD 1 = 5."""
    return [
        ev("segment_alloc", SEG_B, 4 * MiB),  # 0
        ev("alloc", OPT, 2 * MiB, OPTIM),  # 1: 7
        ev("segment_alloc", SEG_C, 16 * MiB),  # 2
        ev("alloc", ACT, 8 * MiB, FWD),  # 3: 15
        ev("alloc", GRAD, 6 * MiB),  # 4: 21, no Python frame (autograd's thread)
        ev("free_requested", GRAD, 6 * MiB),  # 5: 21, still allocated until the free completes
        ev("alloc", CKPT, 3 * MiB, RECOMPUTE),  # 6: 24 = the peak
        ev("free_completed", GRAD, 6 * MiB),  # 7: 18
        ev("free_requested", ACT, 8 * MiB, BACKWARD_FREE),  # 8
        ev("free_completed", ACT, 8 * MiB, BACKWARD_FREE),  # 9: 10 (frames of the free, not the alloc)
        ev("free_requested", CKPT, 3 * MiB, RECOMPUTE),  # 10
        ev("free_completed", CKPT, 3 * MiB, RECOMPUTE),  # 11: 7
        ev("segment_free", SEG_C, 16 * MiB),  # 12
        {"action": "oom", "device_free": 0, "size": 64 * MiB, "stream": 0, "frames": []},  # 13
        ev("free_requested", OLD, 1 * MiB, LOADER),  # 14
        ev("free_completed", OLD, 1 * MiB, LOADER),  # 15: 6; its alloc predates the window
        ev("snapshot", 0, 6 * MiB),  # 16
    ]


def block(addr: int, size: int, state: str, frames: list | None = None, requested: int | None = None) -> dict:
    return {
        "address": addr,
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": frames or [],
    }


def snapshot() -> dict:
    seg_a = {
        "device": 0,
        "address": SEG_A,
        "total_size": 8 * MiB,
        "allocated_size": 4 * MiB,
        "stream": 0,
        "blocks": [
            block(PARAM, 4 * MiB, "active_allocated", INIT),
            block(OLD, 4 * MiB, "inactive"),  # OLD and CKPT's space, merged back
        ],
    }
    seg_b = {
        "device": 0,
        "address": SEG_B,
        "total_size": 4 * MiB,
        "allocated_size": 2 * MiB,
        "stream": 0,
        "blocks": [block(OPT, 2 * MiB, "active_allocated", OPTIM), block(OPT + 2 * MiB, 2 * MiB, "inactive")],
    }
    other_device = {
        "device": 1,
        "address": SEG_A,
        "total_size": 20 * MiB,
        "allocated_size": 20 * MiB,
        "stream": 0,
        "blocks": [block(SEG_A, 20 * MiB, "active_allocated")],
    }
    return {"segments": [seg_a, seg_b, other_device], "device_traces": [trace(), []]}


def test_peak_mid_trace_with_its_live_set_and_reserved():
    r = mp.analyze(snapshot(), device=0)

    # At the dump: PARAM 4 + OPT 2 allocated; segments A 8 + B 4 reserved.
    assert r["dump_allocated_bytes"] == (4 + 2) * MiB
    assert r["dump_reserved_bytes"] == (8 + 4) * MiB
    assert r["dump_slack_bytes"] == (12 - 6) * MiB
    assert r["dump_inactive_blocks"] == 2 and r["dump_inactive_bytes"] == (4 + 2) * MiB
    assert r["dump_largest_inactive_bytes"] == [4 * MiB, 2 * MiB]

    # The peak: right after event 6, PARAM 4 + OLD 1 + OPT 2 + ACT 8 + GRAD 6 (free requested only) + CKPT 3.
    peak = (4 + 1 + 2 + 8 + 6 + 3) * MiB
    assert r["peak_allocated_bytes"] == peak
    assert r["peak_event_index"] == 6 and r["peak_point"] == 7
    assert r["peak_event"] == {
        "action": "alloc",
        "bytes": 3 * MiB,
        "category": "torch/utils/checkpoint.py:unpack_hook",
    }
    # Reserved there: the dump's 12 + segment C (freed after the peak, event 12) 16.
    assert r["peak_reserved_bytes"] == (12 + 16) * MiB
    assert r["peak_slack_bytes"] == (28 - 24) * MiB
    # Window start: PARAM + OLD allocated; segments B and C not yet there: 28 - 4 - 16 reserved.
    assert r["window_start_allocated_bytes"] == (4 + 1) * MiB
    assert r["window_start_reserved_bytes"] == (28 - 4 - 16) * MiB
    assert r["window_max_reserved_bytes"] == 28 * MiB

    cats = {row["category"]: (row["bytes"], row["count"]) for row in r["peak_categories"]}
    assert cats == {
        "titanrush/models/llama.py:forward": (8 * MiB, 1),  # ACT: its alloc's frames, not its free's
        mp.NO_PYTHON: (6 * MiB, 1),  # GRAD
        "titanrush/models/llama.py:init_weights": (4 * MiB, 1),  # PARAM, frames from the dump's block
        "torch/utils/checkpoint.py:unpack_hook": (3 * MiB, 1),  # CKPT: innermost matching frame
        "torch/optim/adamw.py:_init_group": (2 * MiB, 1),  # OPT
        "titanrush/data/loader.py:prefetch": (1 * MiB, 1),  # OLD: alloc before the window, free's frames
    }
    sizes = [row["bytes"] for row in r["peak_categories"]]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == peak
    assert r["peak_categories"][0]["share"] == 8 / 24

    assert r["oom_events"] == 1 and r["inconsistent_events"] == 0
    assert not r["hit_max_entries"] and not r["window_may_be_truncated"]


def test_top_folds_the_rest_into_other():
    rows = mp.analyze(snapshot(), device=0, top=2)["peak_categories"]
    assert [row["category"] for row in rows] == [
        "titanrush/models/llama.py:forward",
        mp.NO_PYTHON,
        "other (4 categories)",
    ]
    assert rows[-1]["bytes"] == (4 + 3 + 2 + 1) * MiB and rows[-1]["count"] == 4


def test_truncated_window_flags():
    snap = snapshot()
    n = len(snap["device_traces"][0])
    full = mp.analyze(snap, device=0, max_entries=n)
    assert full["hit_max_entries"] and full["window_may_be_truncated"]
    assert "ring buffer wrapped" in mp.format_report(full)

    # A window that only frees: the peak is its first point, so memory may have been higher before it.
    snap["device_traces"][0] = snap["device_traces"][0][14:]  # OLD's free, then the snapshot event
    r = mp.analyze(snap, device=0)
    assert r["peak_point"] == 0 and r["peak_event_index"] is None
    assert r["peak_allocated_bytes"] == (4 + 2 + 1) * MiB
    assert not r["hit_max_entries"] and r["peak_at_window_start"] and r["window_may_be_truncated"]


def test_device_choice_and_other_device_ignored():
    snap = snapshot()
    assert mp.pick_device(snap) == 1  # 20 MiB reserved there against 12 on device 0
    r = mp.analyze(snap, device=1)
    assert r["trace_events"] == 0 and r["peak_allocated_bytes"] == 20 * MiB
    assert r["dump_reserved_bytes"] == 20 * MiB


def test_categories():
    assert mp.category([]) == mp.NO_PYTHON
    assert mp.category([frame("??", "at::native::empty_cuda")]) == mp.NO_PYTHON  # C++ frames only
    assert mp.category([frame("/home/u/script.py", "main")]) == mp.OTHER_PYTHON
    # A venv inside a checkout called titanrush: torch/nn is not ours, the frame after it is.
    venv = "/home/u/titanrush/.venv/lib/python3.11/site-packages"
    frames = [
        frame(f"{venv}/torch/nn/modules/linear.py", "forward"),
        frame(f"{venv}/torchao/float8/x.py", "f"),
    ]
    assert mp.category(frames) == "torchao/float8/x.py:f"
    fsdp = frame(f"{venv}/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "unshard")
    assert mp.category([fsdp]) == "torch/distributed/fsdp/_fully_shard/_fsdp_param.py:unshard"


def test_cli_reads_pickle_and_writes_json(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    out = tmp_path / "peak.json"
    assert mp.main([str(path), "--device", "0", "--top", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "peak within the recorded window" in text and "titanrush/models/llama.py:forward" in text
    data = json.loads(out.read_text())
    assert data["peak_allocated_bytes"] == 24 * MiB and len(data["peak_categories"]) == 4


def test_refuses_pickled_objects(tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": Path("/")}))
    with pytest.raises(pickle.UnpicklingError):  # a pickled object is not loaded
        mp.load_snapshot(path)


def test_rewind_matches_a_forward_simulation():
    """Random allocator histories, run forwards: the backward walk must recover every point's totals."""
    rng = random.Random(0)
    for _ in range(20):
        live: dict[int, int] = {}  # addr -> requested size, allocated (free_completed not yet seen)
        pending: set[int] = set()  # free requested, not completed
        segments: dict[int, int] = {}
        events, allocated, reserved = [], [0], [0]
        next_addr = 0x1000
        for _ in range(200):
            r = rng.random()
            if r < 0.1:
                size = rng.choice([2, 20]) * MiB
                segments[next_addr] = size
                events.append(ev("segment_alloc", next_addr, size))
                next_addr += size
            elif r < 0.15 and segments:
                addr = rng.choice(sorted(segments))
                events.append(ev("segment_free", addr, segments.pop(addr)))
            elif r < 0.55:
                size = rng.randrange(1, 1000) * 512
                live[next_addr] = size
                events.append(ev("alloc", next_addr, size, rng.choice([FWD, OPTIM, []])))
                next_addr += size
            elif r < 0.8 and set(live) - pending:
                addr = rng.choice(sorted(set(live) - pending))
                pending.add(addr)
                events.append(ev("free_requested", addr, live[addr]))
            elif pending:
                addr = rng.choice(sorted(pending))
                pending.discard(addr)
                events.append(ev("free_completed", addr, live.pop(addr)))
            else:
                continue
            allocated.append(sum(live.values()))
            reserved.append(sum(segments.values()))
        # The dump: what is live (pending frees still allocated), in one segment holding all of it.
        blocks = [
            block(a, s, "active_pending_free" if a in pending else "active_allocated")
            for a, s in live.items()
        ]
        seg = {"device": 0, "address": 0, "total_size": reserved[-1], "stream": 0, "blocks": blocks}
        snap = {"segments": [seg], "device_traces": [events]}

        tl = mp.timeline(events, mp.live_at_dump(snap, 0), mp.reserved_at_dump(snap, 0))
        assert tl.allocated == allocated and tl.inconsistent == 0
        assert tl.reserved == reserved
        r = mp.analyze(snap, device=0)
        assert r["peak_allocated_bytes"] == max(allocated)
        assert r["peak_point"] == allocated.index(max(allocated))
        assert sum(row["bytes"] for row in r["peak_categories"]) == max(allocated)
