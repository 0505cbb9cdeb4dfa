"""Every mesh trains like one process: the real trainer as several ranks (gloo, CPU) against one process.

Each run logs the global mean loss and the global gradient norm (before clipping) at every one of its 6
steps; both must agree with the single-process run to a relative RTOL at every step. The global batch is
the same 4 sequences per step on every mesh, so the only differences are the order of floating-point
sums (sharded reductions, all-reduces, partial products under TP). Measured on this 2-core CPU host,
the largest deviation over all meshes is 2.1e-7 (a couple of fp32 ulps); RTOL = 1e-5 leaves 50x headroom
for other CPUs' kernels while still failing on any real bug (a gradient reduced twice or not at all,
a mis-sharded weight, a wrong RoPE slice: each is off by 1e-3 or more from the first step on).

Activation checkpointing recomputes the same ops on the same inputs: bitwise equal here (still checked
to RTOL). Compile fuses element-wise ops differently: measured 8e-8.

The module's runs share one launch per number of processes (`harness.Cases`); each test reads its run's rows.
"""

from __future__ import annotations

import pytest
from harness import Cases, max_rel_dev

pytestmark = pytest.mark.parallel

RTOL = 1e-5


def assert_parity(rows: list[dict], ref: list[dict], rtol: float = RTOL, name: str = "") -> None:
    devs = {key: max_rel_dev(rows, ref, key) for key in ("loss", "grad_norm")}
    if name:  # shown with pytest -s: the figures of docs/parallelism.md
        print(f"\nparity {name}: loss {devs['loss']:.1e} grad_norm {devs['grad_norm']:.1e}")
    for key, dev in devs.items():
        assert dev <= rtol, (key, dev, [r[key] for r in rows], [r[key] for r in ref])
    assert ref[-1]["loss"] < ref[0]["loss"]  # it trains


MESHES = {
    # name: (processes, data-parallel degree, overrides)
    "fsdp2": (2, 2, []),
    "ddp2": (2, 2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]),
    "tp2": (2, 1, ["--parallelism.tp", "2"]),
    "tp2_no_sp_no_loss_parallel": (
        2,
        1,
        ["--parallelism.tp", "2", "--no-parallelism.sequence_parallel", "--no-parallelism.loss_parallel"],
    ),
    "fsdp2_tp2": (4, 2, ["--parallelism.tp", "2"]),
    "hsdp2x2": (4, 4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
    # Sequence-parallel activations cross the pipeline stage boundary as plain local shards.
    "pp2_tp2": (4, 1, ["--parallelism.pp", "2", "--parallelism.tp", "2"]),
    "fsdp2_reshard_always": (2, 2, ["--parallelism.fsdp_reshard_after_forward", "always"]),
    "fsdp2_reshard_never_cpu_offload": (
        2,
        2,
        ["--parallelism.fsdp_reshard_after_forward", "never", "--parallelism.fsdp_cpu_offload"],
    ),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_matches_single_process(name, runs):
    assert_parity(runs.train(name), runs.ref(), name=name)


AC = {
    "full": ["--activation_checkpoint.mode", "full"],
    "selective_op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "op"],
    "selective_every_2nd": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective=2"],
}


@pytest.mark.parametrize("name", list(AC))
def test_activation_checkpointing_changes_nothing(name, runs):
    assert_parity(runs.train(f"ac_{name}"), runs.ref(), name=f"ac_{name}")


COMPILED = {
    # name: (processes, data-parallel degree, overrides)
    "single_selective_op": (1, 1, ["--activation_checkpoint.mode", "selective"]),
    "fsdp2": (2, 2, []),
    "tp2": (2, 1, ["--parallelism.tp", "2"]),
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_compile_changes_nothing_beyond_rounding(name, runs):
    assert_parity(runs.train(f"compile_{name}"), runs.ref(), name=f"compile_{name}")


BF16 = ("--training.precision", "bf16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference) -> Cases:
    """Every run of this module: one launch of 2 processes, one of 4, and one of 1 (with the references)."""
    cases = Cases(tmp_path_factory.mktemp("parity"), reference, refs=[(), BF16])
    for name, (nproc, dp, overrides) in MESHES.items():
        cases.add(name, nproc, *overrides, dp=dp)
    for name, overrides in AC.items():
        cases.add(f"ac_{name}", 1, *overrides)
    for name, (nproc, dp, overrides) in COMPILED.items():
        cases.add(f"compile_{name}", nproc, "--compile.enable", *overrides, dp=dp)
    cases.add("fsdp_bf16", 2, *BF16)
    return cases


def test_fsdp_bf16_mixed_precision_trains_like_single_process_bf16(runs):
    """bf16 compute, fp32 master weights and reductions. One process autocasts, FSDP casts the gathered
    parameters: the roundings differ, so only closeness at bf16's resolution is expected."""
    ref = runs.ref(*BF16)
    rows = runs.train("fsdp_bf16")
    assert max_rel_dev(rows, ref, "loss") < 2e-2, ([r["loss"] for r in rows], [r["loss"] for r in ref])
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
