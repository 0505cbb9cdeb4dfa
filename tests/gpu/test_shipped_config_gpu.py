"""The shipped 8B config's settings on one GPU, the model shrunk to the debug flavor: compiled blocks,
selective per-op activation checkpointing, bf16, a full checkpoint, and a second launch resuming from it.

The checkpoint must hold the model's own names (neither the recomputing wrapper's nor compile's), so
that it loads into any run (tests/unit/test_checkpoint.py checks the same on CPU).
"""

from __future__ import annotations

import math

from gpu_launch import ROOT, launch
from torch.distributed.checkpoint import FileSystemReader

SMALL = [
    "--config",
    str(ROOT / "train_configs" / "llama8b_fsdp.toml"),
    "--activation_checkpoint.mode",  # (the config's auto would pick none for the debug model)
    "selective",
    "--model.flavor",
    "debug",
    "--training.seq_len",
    "512",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--no-metrics.tensorboard",
]


def test_the_8b_config_saves_and_resumes_on_one_gpu(tmp_path):
    launch(tmp_path, "run", 1, [*SMALL, "--training.steps", "2"])
    names = (
        FileSystemReader(str(tmp_path / "run" / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    )
    assert "model.layers.0.attention.wq.weight" in names
    assert not [n for n in names if "_checkpoint_wrapped_module" in n or "_orig_mod" in n]
    rows, log = launch(tmp_path, "run", 1, [*SMALL, "--training.steps", "4"])
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values()), log[-2000:]
    assert any(r.get("ckpt_load_s") is not None for r in rows), log[-2000:]
