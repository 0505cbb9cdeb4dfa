"""On GPUs: the GPU memory rule takes the device's memory, and a job of several GPU processes prints each
warning once and no DeviceMesh deprecation (NCCL; the CPU versions are tests/parallel/test_console.py)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from titanrush.tools import rush_runner
from titanrush.tools.estimate import gpu_memory

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_memory_rule_takes_this_gpus_memory():
    props = torch.cuda.get_device_properties(0)
    gib, note = gpu_memory(None)
    assert gib == pytest.approx(props.total_memory / 2**30) and props.name in note
    # The rush and the sweep ask a child process; the same answer.
    assert gpu_memory(None, rush_runner.probe_device()) == (gib, note)
    assert gpu_memory(141.0) == (141.0, "141 GiB per GPU (--gpu-mem)")  # --gpu-mem wins


def run_train_sh(tmp: Path, ngpu: int, *args: str) -> str:
    """`NGPU=ngpu ./run_train.sh` on the debug model (OMP_NUM_THREADS left to run_train.sh)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(
        NGPU=str(ngpu), NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"
    )
    cmd = [
        "./run_train.sh",
        "--job.dump_folder",
        str(tmp),
        "--training.steps",
        "3",
        "--data.dataset",
        "synthetic",
        "--training.precision",
        "bf16",
        *args,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-8000:]
    return out


def assert_quiet(out: str) -> None:
    assert "OMP_NUM_THREADS" not in out and "Slicing a flattened dim" not in out, out
    assert out.count("step 3  loss") == 1 and "[rank1] step" not in out, out  # rank 0's lines, once
    shown = re.findall(r"^\S+:\d+: (\w*Warning: .*)$", out, flags=re.M)  # Python's warning lines
    assert len(shown) == len(set(shown)), shown


@pytest.mark.multigpu
def test_two_gpu_compiled_run_prints_each_warning_once(tmp_path):
    assert_quiet(run_train_sh(tmp_path, 2, "--compile.enable"))


@pytest.mark.multigpu(4)
def test_hsdp_and_tp_meshes_print_no_mesh_deprecation(tmp_path):
    """HSDP's 2-D mesh (dp_replicate x dp_shard_cp) and FSDP x TP, from the views build_mesh keeps."""
    out = run_train_sh(tmp_path / "hsdp", 4, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2")
    assert_quiet(out)
    assert_quiet(run_train_sh(tmp_path / "tp", 4, "--parallelism.tp", "2"))


def test_a_model_too_large_for_the_gpu_is_one_line_naming_the_fix(tmp_path):
    # a 2e8-token table of width 256 (205 GB in fp32): the memory check refuses it before anything is built
    # (exit 2, the estimate against this GPU's memory); started anyway, it is materialized on the GPU and
    # runs out of memory (exit 1, one line naming the fix)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [
        "./run_train.sh",
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "1",
        "--model.vocab_size",
        "200000000",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env={**env, "NGPU": "1"}, capture_output=True, text=True, timeout=600)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr[-4000:]
    assert err[0].startswith("titanrush: config error: the run does not fit the GPU"), err
    assert "GiB per GPU against" in err[0] and "CUDA out of memory" not in res.stderr
    assert not (tmp_path / "debug").exists()  # refused before the run folder was made

    anyway = [*cmd, "--plan.memory_check", "false"]
    res = subprocess.run(
        anyway, cwd=ROOT, env={**env, "NGPU": "1"}, capture_output=True, text=True, timeout=600
    )
    err = res.stderr.strip().splitlines()
    assert res.returncode == 1, res.stderr[-4000:]
    assert err[-1].startswith("titanrush: error: out of memory on rank 0: CUDA out of memory"), err[-3:]
    assert "titanrush estimate" in err[-1] and "Traceback" not in res.stderr
    assert rush_runner.classify(1, res.stdout + res.stderr)[0] == rush_runner.OOM
