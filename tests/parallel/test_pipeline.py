"""Pipeline parallel trains like one process, and every rank logs the true loss and grad norm; context
parallel's plumbing with and without pipelining.

The real trainer in several processes (gloo, CPU) against the single-process run of the same global batch
(6 steps). Stages differ from the single process only in where the sums of the loss and of the squared
gradients are taken (per micro-batch, per stage), so the tolerance is the parity suite's RTOL.

Context parallel's ring attention needs CUDA: its parity (CP x PP against one GPU) is a GPU test
(tests/gpu/test_context_parallel_gpu.py); here `cp_probe.py` checks, through the trainer's own step on
gloo, that every stage's attention rotates each token by its true position.

The module's runs share one launch per number of processes (`harness.Cases`); each test reads its run's rows.
"""

from __future__ import annotations

import json
import math

import pytest
from harness import STEPS, Cases, max_rel_dev
from test_parity import RTOL, assert_parity

pytestmark = pytest.mark.parallel

PP = {
    # name: (processes, data-parallel degree, overrides)
    "pp2_1f1b": (2, 1, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"]),
    "pp2_gpipe": (2, 1, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "GPipe"]),
    "pp2_interleaved_1f1b": (2, 1, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B"]),
    "pp2_zbv": (2, 1, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble"]),
    "pp2_interleaved_zb": (
        2,
        1,
        ["--parallelism.pp", "2", "--parallelism.pp_schedule", "InterleavedZeroBubble"],
    ),
    "pp2_fsdp2_1f1b": (4, 2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"]),
    "pp2_fsdp2_gpipe": (4, 2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "GPipe"]),
    "pp2_tp2_1f1b": (4, 1, ["--parallelism.pp", "2", "--parallelism.tp", "2", "--parallelism.dp_shard", "1"]),
    "pp2_fsdp2_interleaved_1f1b": (  # a local batch of 2: one micro-batch per stage pair
        4,
        2,
        [
            "--parallelism.pp",
            "2",
            "--parallelism.pp_schedule",
            "Interleaved1F1B",
            "--parallelism.pp_microbatches",
            "2",
        ],
    ),
}


VAL = ("--validation.freq", "3", "--validation.steps", "2")
BF16 = ("--training.precision", "bf16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference) -> Cases:
    """Every run of this module: one launch of 2 processes, one of 4, and one of 1 (with the references)."""
    dump = tmp_path_factory.mktemp("pipeline")
    cases = Cases(dump, reference, refs=[(), BF16])
    for name, (nproc, dp, overrides) in PP.items():
        cases.add(name, nproc, *overrides, "--metrics.all_ranks", dp=dp)
    split = ("--parallelism.pp_layers_per_stage", "1,3", "--parallelism.pp_microbatches", "4")
    cases.add("pp2_split", 2, "--parallelism.pp", "2", *split, dp=1)
    cases.add("val1", 1, *VAL)
    cases.add("val_pp2", 2, "--parallelism.pp", "2", *VAL, dp=1)
    cases.add("pp_bf16", 2, *BF16, "--parallelism.pp", "2", dp=1)
    for name, (nproc, overrides) in CP.items():  # (last: context parallel's rotate method is a global)
        args = [
            "--job.dump_folder",
            str(dump),
            "--job.name",
            name,
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--training.precision",
            "fp32",
            "--no-metrics.tensorboard",
            *overrides,
        ]
        cases.add_probe(name, nproc, "cp", [str(dump / f"{name}_reports"), *args])
    return cases


@pytest.mark.parametrize("name", list(PP))
def test_pipeline_matches_single_process_on_every_rank(name, runs):
    nproc = PP[name][0]
    ref = runs.ref()
    assert_parity(runs.train(name), ref)
    # Every rank, the first stage's included, logs the true loss and the true global grad norm.
    for rank in range(1, nproc):
        other = runs.rows(name, rank)
        assert [r["step"] for r in other] == list(range(1, STEPS + 1))
        assert_parity(other, ref, RTOL)


def test_explicit_layer_split_and_microbatches(runs):
    assert_parity(runs.train("pp2_split"), runs.ref())


def test_pipeline_validation_matches_single_process(runs):
    """Forward-only pipeline passes over the held-out split give the single process's validation loss."""

    one = [r for r in runs.rows("val1") if "val_loss" in r]
    pp = [r for r in runs.rows("val_pp2") if "val_loss" in r]
    assert [r["step"] for r in pp] == [r["step"] for r in one] == [3, 6]
    for a, b in zip(pp, one):
        assert abs(a["val_loss"] - b["val_loss"]) <= RTOL * b["val_loss"]


def test_pipeline_without_fsdp_trains_in_bf16(runs):
    """precision = bf16 without FSDP is autocast, which the pipeline schedule's forward must run under.

    (Found on 4 H200s: PP2 x TP2 ran its matmuls in fp32 at 3.5% MFU.) A bf16 pipeline run must be
    much closer to the one-process bf16 run than the one-process fp32 run is.
    """

    one_bf16, one_fp32 = runs.ref(*BF16), runs.ref()  # (the session's references: the same runs)
    pp_bf16 = runs.rows("pp_bf16")
    # The first step's gradient norm is the sharp witness: later steps drift apart in bf16 whatever the
    # mesh, and the loss's rounding averages out over the batch.
    precision_gap = max_rel_dev(one_fp32[:1], one_bf16[:1], "grad_norm")
    assert precision_gap > 5e-5  # bf16 really moves it on this model
    assert max_rel_dev(pp_bf16[:1], one_bf16[:1], "grad_norm") < precision_gap / 10


CP = {
    # name: (processes, overrides)
    "cp2": (2, ["--parallelism.cp", "2"]),
    "cp2_pp2_1f1b": (
        4,
        ["--parallelism.cp", "2", "--parallelism.pp", "2", "--parallelism.pp_schedule", "1F1B"],
    ),
    # split backward (input, then weight gradients) and two stages per rank in a V
    "cp2_pp2_zbv": (
        4,
        ["--parallelism.cp", "2", "--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble"],
    ),
}


@pytest.mark.parametrize("name", list(CP))
def test_context_parallel_shards_every_stage_table_with_the_batch(name, runs):
    """Two steps of the trainer's forward/backward under CP (x PP), and with PP a validation pass: every
    attention call of every stage on every rank rotated with the table's rows at its tokens' positions,
    the tables were whole again after each step, and every rank has the same finite loss and gradient
    norm (`cp_probe.py`)."""
    runs.run(name)
    nproc, out = CP[name][0], runs.dump / f"{name}_reports"
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert all(all(n > 0 for n in r["calls"]) for r in reports)  # every rank's stages attended, each step
    for key in ("losses", "grad_norms"):
        values = [r[key] for r in reports]
        assert all(v == values[0] for v in values), (key, values)
        assert all(math.isfinite(x) and x > 0 for x in values[0])
    if "pp" in name and "zbv" not in name:  # the pipeline's validation pass, sharded like its training
        values = [r["val_loss"] for r in reports]
        assert all(v == values[0] for v in values) and math.isfinite(values[0]) and values[0] > 0
