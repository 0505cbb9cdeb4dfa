"""scripts/trace_summary.py: the timeline figures of a Chrome trace, against hand arithmetic."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import trace_summary as ts  # noqa: E402


def _kernel(name: str, start: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"stream": stream}}


def _trace() -> dict:
    # Two steps' worth of CPU step ranges (kernel figures are per step: halved).
    return {
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 15},
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 15, "dur": 15},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 15},
            _kernel("nvjet_tst_128x256_sm90", 0, 10),  # matmul
            _kernel("triton_poi_fused_add_0", 12, 8),  # compiled
            _kernel("ncclDevKernel_AllGather_RING_LL", 5, 10, stream=20),  # comm, [10, 12) exposed
            _kernel("ncclDevKernel_ReduceScatter_Sum", 22, 2, stream=20),  # comm, all exposed
            _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 25, 5),  # attention
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 24, "dur": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},  # host side: ignored
        ]
    }


def test_timeline_figures_against_hand_arithmetic():
    s = ts.summarize(_trace())
    assert s["steps"] == 2
    # span 0..30 = 30 us over 2 steps = 0.015 ms per step
    assert s["span_ms"] == pytest.approx(30e-3 / 2)
    # compute: [0,10] + [12,20] + [24,25] + [25,30] = 10 + 8 + 6 = 24 us
    assert s["compute_busy_ms"] == pytest.approx(24e-3 / 2)
    # communication union: [5,15] + [22,24] = 12 us; exposed: [10,12] + [22,24] = 4 us
    assert s["communication_ms"] == pytest.approx(12e-3 / 2)
    assert s["exposed_communication_ms"] == pytest.approx(4e-3 / 2)
    # nothing runs in [20,22]: 2 us idle
    assert s["idle_ms"] == pytest.approx(2e-3 / 2)
    kinds = s["by_kind_ms"]
    assert kinds["matmul"] == pytest.approx(5e-3)
    assert kinds["communication"] == pytest.approx(6e-3)
    assert kinds["attention"] == pytest.approx(2.5e-3)
    assert kinds["compiled"] == pytest.approx(4e-3)
    assert kinds["other"] == pytest.approx(0.5e-3)  # the memcpy


def test_minus_handles_many_overlaps():
    a = ts._union([(0, 100)])
    b = ts._union([(10, 20), (15, 30), (50, 60), (90, 120)])
    assert ts._minus(a, b) == pytest.approx(100 - 20 - 10 - 10)
    assert ts._minus(b, a) == pytest.approx(20)  # [100, 120)


def test_cli_reads_gzip_and_rejects_missing_files(tmp_path):
    path = tmp_path / "rank0.trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(_trace(), fh)
    script = str(ROOT / "scripts" / "trace_summary.py")
    ok = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "exposed communication" in ok.stdout and "nvjet_tst_128x256_sm90" in ok.stdout
    bad = subprocess.run(
        [sys.executable, script, str(tmp_path / "nope.json")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "no trace file" in bad.stderr


def test_a_trace_without_kernels_is_an_error():
    with pytest.raises(ValueError, match="no GPU kernels"):
        ts.summarize({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]})


def test_gaps_name_their_place_length_communication_and_neighbours():
    gaps = ts.summarize(_trace())["gaps"]
    # compute runs [0,10], [12,20], [24,30]: two stretches without it, the longer first
    assert [(g["at_ms"], g["ms"], g["comm_ms"]) for g in gaps] == [
        pytest.approx((20e-3, 4e-3, 2e-3)),  # [20,24): the reduce-scatter fills [22,24)
        pytest.approx((10e-3, 2e-3, 2e-3)),  # [10,12): the all-gather fills it
    ]
    assert (gaps[0]["before"], gaps[0]["after"]) == ("triton_poi_fused_add_0", "Memcpy DtoD")
    assert (gaps[1]["before"], gaps[1]["after"]) == ("nvjet_tst_128x256_sm90", "triton_poi_fused_add_0")
    text = ts.render("t", ts.summarize(_trace()), top=3, gaps=1)
    assert "1 longest stretches" in text and "before Memcpy DtoD" in text and "before triton_poi" not in text
