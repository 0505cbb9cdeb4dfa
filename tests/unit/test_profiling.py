"""The profiler: its step boundaries (a GPU sync only where a recorded window opens or closes) and what a
trace says (the timeline: compute, exposed communication, copies, idle; the kernels, GEMMs by shape)."""

from __future__ import annotations

import pytest
import torch

from titanrush.profiling import Profiler
from titanrush.tools.trace_analysis import (
    collective_table,
    collectives,
    kernel_differences,
    kernels,
    timeline,
)


def test_sync_only_around_the_recorded_window(tmp_path, monkeypatch):
    prof = Profiler(
        tmp_path, enable=True, freq=4, active=1, memory_snapshot=False, rank=0, all_ranks=False, start_step=0
    )
    synced_after: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synced_after.append(prof.step_num))
    try:
        for _ in range(8):
            torch.ones(4) @ torch.ones(4)  # some work in each step
            prof.step()
    finally:
        prof.close()
    # freq 4, one active step: steps 1-2 wait, 3 warms up, 4 is recorded (and 5-8 again); the sync runs
    # as each of steps 3, 4, 7, 8 ends (step_num is already the finished step's number when it runs).
    assert synced_after == [3, 4, 7, 8]
    assert sorted(p.parent.name for p in (tmp_path / "profile").glob("step-*/rank0.trace.json.gz")) == [
        "step-4",
        "step-8",
    ]


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_timeline_splits_each_step_into_compute_exposed_communication_copies_and_idle():
    """Two recorded steps of 100 us drawn by hand. Step 1: compute 0-40 and 50-80 on two streams, an
    all-gather 30-60 (10 us of it with no compute beside it), a reduce-scatter 90-95 (all 5 exposed), a
    copy 82-86, nothing else (idle 80-82, 86-90, 95-100: 11 us). Step 2 (200-300): one GEMM 200-290 with
    an all-reduce under it (none exposed), idle 290-300. A kernel outside the steps and CPU ops do not
    count. Per step: compute (70 + 90) / 2 = 80, comm (35 + 20) / 2 = 27.5, exposed 7.5, copy 2, idle
    10.5; the four parts add up to the step. Compute kernels by kind, per step: matmul (40 + 90) / 2 = 65,
    compiled (Triton) 30 / 2 = 15."""
    events = [
        _x("gpu_user_annotation", "ProfilerStep#5", 0, 100),
        _x("gpu_user_annotation", "ProfilerStep#6", 200, 100),
        _x("kernel", "sm90_xmma_gemm_bf16", 0, 40),
        _x("kernel", "triton_poi_fused_mul_0", 50, 30),
        _x("kernel", "ncclDevKernel_AllGather_RING_LL", 30, 30),
        _x("kernel", "ncclDevKernel_ReduceScatter_Sum", 90, 5),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 82, 4),
        _x("kernel", "nvjet_tst_gemm", 200, 90),
        _x("kernel", "ncclDevKernel_AllReduce_Sum", 240, 20),
        _x("kernel", "sm90_xmma_gemm_bf16", 400, 50),  # after the recorded steps
        _x("cpu_op", "aten::mm", 0, 1000),
    ]
    t = timeline({"traceEvents": events})
    want = {
        "steps": 2,
        "step": 0.1,
        "compute": 0.080,
        "comm": 0.0275,
        "exposed_comm": 0.0075,
        "copy": 0.002,
        "idle": 0.0105,
        "kernel_matmul": 0.065,
        "kernel_compiled": 0.015,
        "kernel_attention": 0,
        "kernel_optimizer": 0,
        "kernel_other": 0,
    }
    assert t == pytest.approx(want)
    assert t["compute"] + t["exposed_comm"] + t["copy"] + t["idle"] == pytest.approx(t["step"])


def _comm(name: str, ts: float, dur: float, tid: int, nelems: int | None = None) -> dict:
    e = {**_x("kernel", name, ts, dur), "tid": tid}
    return {**e, "args": {"In msg nelems": nelems}} if nelems else e


def test_collectives_say_which_communication_the_step_waits_for_and_which_shares_the_links():
    """Two recorded steps of 200 us drawn by hand, the same in each. A GEMM 0-100 on stream 7; a
    tensor-parallel bf16 reduce-scatter 90-130 on stream 20 (30 us with no compute beside it, 10 us beside
    the FSDP one); an FSDP fp32 reduce-scatter 120-160 on stream 21 (all 40 exposed, 10 concurrent) and a
    second one 170-180 (10 exposed, alone). Per step: TP 1 call, 40 / 30 / 10 us; FSDP 2 calls, 50 / 50 / 10.
    The message size is in the key where the trace records it."""
    rs = "ncclDevKernel_ReduceScatter_Sum_{}_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    events = []
    for step, t0 in ((1, 0), (2, 1000)):
        events += [
            _x("gpu_user_annotation", f"ProfilerStep#{step}", t0, 200),
            _comm("nvjet_tst_gemm", t0, 100, 7),
            _comm(rs.format("bf16"), t0 + 90, 40, 20, 67108864),
            _comm(rs.format("f32"), t0 + 120, 40, 21),
            _comm(rs.format("f32"), t0 + 170, 10, 21),
        ]
    got = collectives({"traceEvents": events})
    tp = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL (67108864 elements)"
    fsdp = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"
    assert got.keys() == {tp, fsdp}
    assert got[tp] == pytest.approx({"calls": 1, "ms": 0.040, "exposed": 0.030, "concurrent": 0.010})
    assert got[fsdp] == pytest.approx({"calls": 2, "ms": 0.050, "exposed": 0.050, "concurrent": 0.010})
    assert timeline({"traceEvents": events})["exposed_comm"] == pytest.approx(0.070)  # 100-160, 170-180


def test_collective_table_sets_two_runs_side_by_side_the_longest_first():
    a = {
        "rs": {"calls": 130, "ms": 43.5, "exposed": 5.0, "concurrent": 12.25},
        "ag": {"calls": 3, "ms": 2.0, "exposed": 0.0, "concurrent": 0.0},
    }
    b = {"rs": {"calls": 130, "ms": 71.8, "exposed": 20.0, "concurrent": 30.0}}
    lines = collective_table(a, b, ("torchtitan", "titanrush")).splitlines()
    assert lines[0] == "| collective | torchtitan: calls, ms, exposed, concurrent | titanrush |"
    assert lines[2:] == [
        "| `rs` | 130, 43.5, 5.0, 12.2 | 130, 71.8, 20.0, 30.0 |",
        "| `ag` | 3, 2.0, 0.0, 0.0 | - |",
    ]


def test_timeline_without_step_ranges_spans_the_kernels_and_refuses_a_cpu_trace():
    events = [_x("kernel", "gemm", 10, 20), _x("kernel", "ncclDevKernel_SendRecv", 25, 15)]
    t = timeline(events)
    assert t["step"] == pytest.approx(0.030) and t["exposed_comm"] == pytest.approx(0.010)
    with pytest.raises(ValueError, match="no GPU kernels"):
        timeline([_x("cpu_op", "aten::mm", 0, 10)])


def _op(name: str, ts: float, dur: float, ext: int, dims: list) -> dict:
    return {
        "ph": "X",
        "cat": "cpu_op",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"External id": ext, "Input Dims": dims},
    }


def _k(name: str, ts: float, dur: float, ext: int | None = None) -> dict:
    return {**_x("kernel", name, ts, dur), "args": {} if ext is None else {"External id": ext}}


def test_kernels_key_gemms_by_the_launching_ops_shapes_and_the_rest_by_name():
    """Two recorded steps of 100 us. Both launch the same cuBLAS kernel for two GEMM shapes (op 1 and 3:
    32x64 @ 64x128, op 2: 32x64 @ 64x64); `aten::linear` wraps op 1, and the innermost matmul op names the
    shape. A Triton kernel runs twice under two inductor indices and argument lists (one key: the index
    changes between compilations), namespaces drop out of the names, NCCL and a copy are left out, and
    the kernel half outside the steps counts only its inside part (10 of 20 us)."""
    events = [
        _x("gpu_user_annotation", "ProfilerStep#3", 0, 100),
        _x("gpu_user_annotation", "ProfilerStep#4", 100, 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 9, "args": {"External id": 1}},
        _op("aten::mm", 1, 5, 1, [[32, 64], [64, 128], []]),
        _op("aten::mm", 20, 5, 2, [[32, 64], [64, 64]]),
        _op("aten::mm", 120, 5, 3, [[32, 64], [64, 128]]),
        _k("nvjet_sm90_tst_gemm", 10, 30, 1),
        _k("nvjet_sm90_tst_gemm", 40, 10, 2),
        _k("nvjet_sm90_tst_gemm", 110, 40, 3),
        _k("triton_poi_fused_silu_0(float*, float*)", 60, 6),
        _k("triton_poi_fused_silu_3(half*, half*)", 150, 4),
        _k("ncclDevKernel_AllGather_RING_LL(args)", 0, 50),
        _x("gpu_memcpy", "Memcpy DtoD", 70, 5),
        _k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 190, 20),
        _k("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<float>(x)", 180, 2),
    ]
    got = kernels({"traceEvents": events})
    assert set(got) == {
        "aten::mm 32x64 @ 64x128",
        "aten::mm 32x64 @ 64x64",
        "triton_poi_fused_silu",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
        "void multi_tensor_apply_kernel<float>",
    }
    assert got["aten::mm 32x64 @ 64x128"] == pytest.approx((1.0, 0.035))  # (30 + 40) us over 2 steps
    assert got["aten::mm 32x64 @ 64x64"] == pytest.approx((0.5, 0.005))
    assert got["triton_poi_fused_silu"] == pytest.approx((1.0, 0.005))
    assert got["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"] == pytest.approx((0.5, 0.005))


def test_kernel_differences_rank_by_the_largest_gap_either_way():
    a = {"mm A": (2.0, 10.0), "mm B": (1.0, 5.0), "silu": (1.0, 1.0)}
    b = {"mm A": (2.0, 10.5), "mm B": (1.0, 2.0), "rope": (1.0, 4.0)}
    got = kernel_differences(a, b, top=3)
    assert [k for k, *_ in got] == ["rope", "mm B", "silu"]
    assert got[0] == ("rope", 0.0, 0.0, 1.0, 4.0) and got[2] == ("silu", 1.0, 1.0, 0.0, 0.0)


def test_a_steps_window_holds_every_kernel_its_host_range_launched_even_after_a_nested_gpu_range():
    """As torch.profiler writes a step whose optimizer runs last (seen on an H200): the GPU's
    `ProfilerStep#5` range ends where the nested `Optimizer.step` range's kernels begin, at 100 of 120 us.
    The step's window is the span of the kernels whose launch (a CUDA runtime call with the kernel's
    correlation id) falls inside the host's `ProfilerStep#5` range: 0-120 here, the optimizer's 20 us
    included; a kernel launched before that range (at 130-140 on the GPU) stays out."""

    def launch(ts: float, corr: int) -> dict:
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": ts,
            "dur": 1,
            "args": {"correlation": corr},
        }

    def kernel(name: str, ts: float, dur: float, corr: int) -> dict:
        return {**_x("kernel", name, ts, dur), "args": {"correlation": corr}}

    events = [
        _x("user_annotation", "ProfilerStep#5", -50, 200),
        _x("gpu_user_annotation", "ProfilerStep#5", 0, 100),
        _x("gpu_user_annotation", "Optimizer.step#AdamW.step", 100, 20),
        launch(-40, 1),
        launch(-30, 2),
        launch(60, 3),
        launch(-60, 9),
        kernel("nvjet_gemm", 0, 90, 1),
        kernel("triton_poi_fused_0", 90, 10, 2),
        kernel("multi_tensor_apply_kernel_FusedAdamMathFunctor", 100, 20, 3),
        kernel("nvjet_gemm", 130, 10, 9),
    ]
    t = timeline({"traceEvents": events})
    assert t["steps"] == 1 and t["step"] == pytest.approx(0.120)
    assert t["kernel_optimizer"] == pytest.approx(0.020) and t["kernel_matmul"] == pytest.approx(0.090)
    assert kernels(events)["multi_tensor_apply_kernel_FusedAdamMathFunctor"] == pytest.approx((1.0, 0.020))
