"""Where the GPUs are asked about: `run_train.sh` and the tools (sweep, rush) ask torch, in a child process,
only on a host with a GPU's device file; elsewhere they know at once that there is none."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titanrush import launch_env
from titanrush.tools import rush_runner

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_device_files_are_nvidias_amds_or_wsls(monkeypatch):
    found: dict[str, list[str]] = {}
    monkeypatch.setattr(launch_env.glob, "glob", lambda pattern: found.get(pattern, []))
    assert not launch_env.gpu_device_files()
    for pattern, path in (
        ("/dev/nvidia[0-9]*", "/dev/nvidia3"),
        ("/dev/kfd", "/dev/kfd"),
        ("/dev/dxg", "/dev/dxg"),
    ):
        found = {pattern: [path]}
        assert launch_env.gpu_device_files(), pattern
    found = {"/dev/nvidiactl": ["/dev/nvidiactl"]}  # (the driver's control file alone: no GPU)
    assert not launch_env.gpu_device_files()


def test_run_train_asks_torch_for_the_gpus_only_on_a_host_with_a_gpu_device_file(tmp_path):
    """NGPU unset: the script counts the GPUs with torch where a device file exists, and takes 1 at once
    where none does (this is what a config error on a CPU machine waits for)."""
    log = tmp_path / "calls.txt"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "NGPU"} | {"PYTHON": str(wrapper)}
    cmd = [
        str(ROOT / "run_train.sh"),
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "2_0",
        "--check",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "training.steps must be an integer" in done.stderr, done.stderr
    asked = [line for line in log.read_text().splitlines() if "device_count" in line]
    assert len(asked) == (1 if launch_env.gpu_device_files() else 0), asked


def test_the_tools_probe_the_device_in_a_child_only_on_a_host_with_a_gpu_device_file(monkeypatch):
    def no_child(*args, **kwargs):
        raise AssertionError("no child process on a host without a GPU")

    monkeypatch.setattr(rush_runner, "gpu_device_files", lambda: False)
    monkeypatch.setattr(rush_runner.subprocess, "run", no_child)
    facts = rush_runner.probe_device()
    assert (facts["torch"], facts["name"], facts["count"], facts["mem_gib"]) == (
        torch.__version__,
        "cpu",
        0,
        None,
    )

    gpu = {"torch": "x", "cuda": True, "name": "NVIDIA H200", "count": 8}
    calls: list[list[str]] = []

    def child(cmd, **kwargs):
        calls.append(cmd)
        return SimpleNamespace(stdout="a warning first\n" + json.dumps(gpu) + "\n")

    monkeypatch.setattr(rush_runner, "gpu_device_files", lambda: True)
    monkeypatch.setattr(rush_runner.subprocess, "run", child)
    assert rush_runner.probe_device() == gpu
    assert calls == [[sys.executable, "-m", "titanrush.tools.device_probe"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer: this host has a GPU")
def test_the_device_probe_module_prints_the_cpus_facts_as_one_json_line():
    out = subprocess.run(
        [sys.executable, "-m", "titanrush.tools.device_probe"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts == rush_runner.device_facts() | {"host_mem_gib": facts["host_mem_gib"]}
    assert facts["cuda"] is False and facts["name"] == "cpu"
