"""Llama 4 (llama4_debug: every layer MoE, 8 experts, top-1) trains the same on every mesh as in one process.

The real trainer in several processes (gloo, CPU), 6 steps of the same global batch as the single-process run
(harness.py). Expert parallel sends each token to the rank holding its expert and back (all-to-all with
variable splits); the experts are sharded over the data-parallel ranks outside EP by FSDP; the loads that
move the routing bias are summed over all data-parallel ranks. So each step's mean loss and global
gradient norm must agree with one process's to the parity suite's RTOL (1e-5): the differences are the
order of floating-point sums, as for the dense meshes. Routing is discrete (top-1 of sigmoid scores), so
a real bug (a token sent to the wrong expert, a gradient summed over the wrong ranks, a bias moved by one
rank's load) shows as O(1e-2) or more from the first steps on.

The checkpoint test saves at EP2 and resumes at EP1 and EP4: the experts (DTensors sharded over ep and
FSDP) and the routing bias (a buffer) reload under the new split, and steps 4-6 match the run that was
never interrupted. Compiled EP2, whose experts take no FSDP unit, saves and resumes in both directions too.

The module's runs share one launch per number of processes (`harness.Cases`); each test reads its run's rows.
"""

from __future__ import annotations

import json

import pytest
from harness import STEPS, Cases
from test_parity import RTOL, assert_parity

pytestmark = pytest.mark.parallel

MOE = ("--model.flavor", "llama4_debug")
P = "--parallelism."
# With pp > 1, torch's pipeline schedule runs every stage's forward once more in its first step, to infer
# the shapes it sends (on the first stage with the first micro-batch, on the others with uninitialized
# activations): that pass's routing is counted with step 1's, so the first bias update differs from one
# process's. EP x PP is therefore compared with the bias frozen (moe.bias_update_rate = 0), where it
# must match to RTOL like every other mesh (docs/moe.md, "Known limits").
FROZEN = ["--moe.bias_update_rate", "0"]
MESHES = {
    # name: (processes, data-parallel degree, overrides; the reference run gets MOE plus the bias rate)
    "ep2": (2, 2, [P + "ep", "2"]),
    "ep2_fsdp2": (4, 4, [P + "ep", "2"]),
    # (EP4: the checkpoint test resumes an EP2 run at EP4 and matches it step for step)
    "fsdp2_no_ep": (2, 2, []),
    "ep2_hsdp": (4, 4, [P + "ep", "2", P + "dp_replicate", "2", P + "dp_shard", "2"]),
    "ep2_pp2": (4, 2, [P + "ep", "2", P + "pp", "2", *FROZEN]),
    # (EP compiled: the exchange test below, at the layer, and tests/gpu/test_moe_gpu.py through the
    # trainer; compiled MoE blocks through the trainer: tp2_compiled_ac_full)
    # full activation checkpointing recomputes the dispatch, all-to-alls included, in backward
    "ep2_ac_full": (2, 2, [P + "ep", "2", "--activation_checkpoint.mode", "full"]),
    "fsdp2_ac_op": (2, 2, ["--activation_checkpoint.mode", "selective"]),
    # per-op checkpointing by parts where the MoE layer holds FSDP units of its own (EP, TP): attention,
    # router and shared expert per op, the experts and their exchange not recomputed
    "ep2_ac_op": (
        2,
        2,
        [
            P + "ep",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.op_matmuls",
            "alternate",
        ],
    ),
    "ep2_compiled_ac_op": (
        2,
        2,
        [P + "ep", "2", "--compile.enable", "--activation_checkpoint.mode", "selective"],
    ),
    "tp2_ac_op": (2, 1, [P + "tp", "2", "--activation_checkpoint.mode", "selective"]),
    # TP shards attention; each tp rank routes its sequence shard (sequence parallel) or all of it
    "tp2": (2, 1, [P + "tp", "2"]),
    "tp2_no_sp": (2, 1, [P + "tp", "2", "--no-parallelism.sequence_parallel"]),
    "tp2_compiled_ac_full": (
        2,
        1,
        [P + "tp", "2", "--compile.enable", "--activation_checkpoint.mode", "full"],
    ),
    "ep2_tp2": (4, 2, [P + "ep", "2", P + "tp", "2"]),
    "tp2_pp2": (4, 1, [P + "tp", "2", P + "pp", "2", *FROZEN]),
}


ROUTER_LOSSES = {
    # name: (mesh, data-parallel degree, losses)
    "ep2_aux_z": ([P + "ep", "2"], 2, ("--moe.aux_loss_coeff", "0.01", "--moe.z_loss_coeff", "0.001")),
    # each tp rank's losses cover its sequence shard, the balance loss's counts summed over the shards:
    # weighed 1/tp, their sum over tp is the whole sequences' loss
    "tp2_aux_z": ([P + "tp", "2"], 1, ("--moe.aux_loss_coeff", "0.01", "--moe.z_loss_coeff", "0.001")),
}
RESUME = {"ep1_one_process": (1, 1, []), "ep4": (4, 4, [P + "ep", "4"]), "tp2": (2, 1, [P + "tp", "2"])}
# Compiled EP2 over both data-parallel ranks leaves the experts out of FSDP (`RunPlan.local_experts`): its
# experts are DTensors over ep alone. Saved there, resumed eager in one process; saved by eager EP2 (the
# experts in FSDP units of one rank), resumed compiled at EP2.
COMPILED = ("--compile.enable",)
RESUME_LOCAL = {
    "ep1_from_compiled": ("saved_ep2_compiled", 1, 1, []),
    "ep2_compiled_from_eager": ("saved_ep2", 2, 2, [P + "ep", "2", *COMPILED]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference) -> Cases:
    """Every run of this module: one launch of 2 processes, one of 4, and one of 1 (with the references)."""
    dump = tmp_path_factory.mktemp("moe")
    refs = [MOE, (*MOE, *FROZEN), *((*MOE, *losses) for _, _, losses in ROUTER_LOSSES.values())]
    cases = Cases(dump, reference, refs=refs)
    save = ("--checkpoint.enable", "--checkpoint.interval", "3")
    cases.add("saved_ep2", 2, *MOE, P + "ep", "2", *save)
    cases.add("saved_ep2_compiled", 2, *MOE, P + "ep", "2", *COMPILED, *save)
    for name, (nproc, dp, overrides) in MESHES.items():
        cases.add(name, nproc, *MOE, *overrides, dp=dp)
    for name, (mesh, dp, losses) in ROUTER_LOSSES.items():
        cases.add(name, 2, *MOE, *losses, *mesh, dp=dp)
    ckpt = str(dump / "saved_ep2" / "checkpoint" / "step-3")
    for target, (nproc, dp, over) in RESUME.items():
        load = ("--checkpoint.load_path", ckpt)
        cases.add(f"resume_{target}", nproc, *MOE, *load, *over, dp=dp, needs=["saved_ep2"])
    for target, (source, nproc, dp, over) in RESUME_LOCAL.items():
        load = ("--checkpoint.load_path", str(dump / source / "checkpoint" / "step-3"))
        cases.add(f"resume_{target}", nproc, *MOE, *load, *over, dp=dp, needs=[source])
    cases.add_probe("ep_probe", 2, "ep", [str(dump / "ep_probe.json")])
    return cases


@pytest.mark.parametrize("name", list(MESHES))
def test_moe_mesh_matches_single_process(name, runs):
    rows = runs.train(name)
    ref = runs.ref(*MOE, *(FROZEN if "pp2" in name else []))
    assert_parity(rows, ref, name=f"moe_{name}")
    if "pp2" not in name:  # (with pipelining, rank 0 holds the first stage's layers only)
        assert [r["moe_imbalance"] for r in rows] == [r["moe_imbalance"] for r in ref]


@pytest.mark.parametrize("name", list(ROUTER_LOSSES))
def test_moe_router_losses_match_single_process(runs, name):
    """The sequence-wise balance loss and the z-loss per rank average to the single process's."""
    losses = ROUTER_LOSSES[name][2]
    rows = runs.train(name)
    ref = runs.ref(*MOE, *losses)
    assert_parity(rows, ref, name=f"moe_{name}")
    plain = runs.ref(*MOE)
    assert any(abs(r["grad_norm"] - q["grad_norm"]) > 1e-4 * q["grad_norm"] for r, q in zip(ref, plain))


@pytest.mark.parametrize("target", list(RESUME) + list(RESUME_LOCAL))
def test_ep2_checkpoint_resumes_at_another_ep_degree(runs, target):
    source = RESUME_LOCAL[target][0] if target in RESUME_LOCAL else "saved_ep2"
    ref = {r["step"]: r for r in runs.rows(source) if "loss" in r}
    assert list(ref) == list(range(1, STEPS + 1))
    rows = [r for r in runs.rows(f"resume_{target}") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(4, STEPS + 1))
    for r in rows:
        for key in ("loss", "grad_norm", "moe_imbalance"):
            assert abs(r[key] - ref[r["step"]][key]) <= RTOL * abs(ref[r["step"]][key]), (target, r, key)


def test_the_exchange_stays_eager_when_compiled_and_a_rank_receives_no_rows(runs):
    """Compiled, the MoE layer under EP2 gives the eager layer's outputs and gradients, also at the steps
    where rank 0's experts receive no rows and one row; no compiled graph holds a collective (traced, the
    exchange was specialized per rank on its row counts; on two GPUs that hung), and neither step
    recompiles anything (unpadded, each did: dynamo specializes sizes 0 and 1). Eager, the layer gives
    the unsharded layer's outputs and gradients on every rank's rows at every step."""
    runs.run("ep_probe")
    for rank, r in enumerate(json.loads((runs.dump / "ep_probe.json").read_text())):
        assert r["graphs_seen"], f"rank {rank}: nothing was compiled"
        assert r["collectives"] == [], f"rank {rank}: collectives in compiled graphs: {r['collectives']}"
        assert r["out"] <= 1e-5 and r["grad"] <= 1e-5, (rank, r)
        assert r["same_routing"] and r["rank0_rows"][3:5] == [0, 1], r["rank0_rows"]
        assert min(r["rank0_rows"][:3]) > 1, r["rank0_rows"]
        assert r["graphs_after_warmup"] == 0, f"rank {rank}: {r['graphs_after_warmup']} recompiles"
        # The eager exchange (its padding included) against one process holding every expert
        assert max(r["one_process"].values()) <= 1e-5, (rank, r["one_process"])
