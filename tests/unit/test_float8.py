"""Float8 through torchao on CPU (emulated): which linears convert, the errors, and training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titanrush import config
from titanrush.config import ConfigError
from titanrush.models.llama import Llama, model_args
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer

pytest.importorskip("torchao", reason="float8 is torchao's; it is a project dependency (pip install -e .)")

from titanrush.parallel.float8 import Float8Plan, apply_float8  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def meta_model(**over) -> Llama:
    with torch.device("meta"):
        return Llama(model_args("debug", **over))


def test_filter_size_and_alignment_rules():
    model = meta_model(vocab_size=8200)  # output 8200 x 256: filtered by name anyway
    names = apply_float8(model, Float8Plan(enable=True, emulate=True, filter_fqns=("output",), min_size=0))
    assert "layers.0.attention.wq" in names and "layers.3.feed_forward.w2" in names
    assert "output" not in names
    assert type(model.output) is torch.nn.Linear
    # The default minimum size keeps the debug model's 256-wide layers in bf16.
    assert apply_float8(meta_model(), Float8Plan(enable=True, emulate=True, filter_fqns=("output",))) == []
    # An empty filter converts the output projection too; a misaligned one never converts.
    converted = apply_float8(
        meta_model(), Float8Plan(enable=True, recipe="rowwise", emulate=True, filter_fqns=(), min_size=0)
    )
    assert "output" in converted
    odd = meta_model(vocab_size=8193)
    assert "output" not in apply_float8(
        odd, Float8Plan(enable=True, emulate=True, filter_fqns=(), min_size=0)
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: no float8 tensor cores")
def test_float8_without_float8_hardware_or_emulation_is_a_clear_error():
    cfg = config.load(None, ["--float8.enable", "--training.precision", "bf16"])
    with pytest.raises(ConfigError, match="float8.emulate = true"):
        build_plan(cfg, 1)


def args(tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "--job.dump_folder",
        str(tmp),
        "--job.name",
        name,
        "--training.steps",
        "4",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--training.precision",
        "bf16",
        "--training.deterministic",
        *extra,
    ]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def float8(recipe: str) -> tuple[str, ...]:
    return ("--float8.enable", "--float8.emulate", "--float8.min_size", "0", "--float8.recipe", recipe)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """`(name, *overrides) -> losses` of a run in this process, each trained once for the module."""
    tmp, done = tmp_path_factory.mktemp("float8"), {}

    def run(name: str, *extra: str) -> list[float]:
        if name not in done:
            cfg = config.load(None, args(tmp, name, *extra))
            trainer = Trainer(cfg, build_plan(cfg, 1))
            trainer.train()
            trainer.close()
            done[name] = losses(tmp / name)
        return done[name]

    return run


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_training_tracks_bf16(one_process, recipe):
    ref, f8 = one_process("bf16"), one_process(recipe, *float8(recipe))
    assert f8[0] == pytest.approx(ref[0], rel=1e-2)  # same weights, float8 rounding only
    assert f8[-1] < f8[0] - 0.5  # and it trains


def test_float8_needs_bf16(tmp_path):
    with pytest.raises(ConfigError, match="float8.enable needs training.precision = 'bf16'"):
        cfg = config.load(None, args(tmp_path, "x", "--training.precision", "fp32", "--float8.enable"))
        Trainer(cfg, build_plan(cfg, 1))


def test_fsdp2_float8_all_gather_matches_one_process(tmp_path, one_process):
    """FSDP's float8 all-gather with precomputed scales (gloo, 2 ranks) trains like one process."""
    two = args(
        tmp_path,
        "two",
        *float8("tensorwise"),
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
    )
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "titanrush.train",
        *two,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = one_process("tensorwise", *float8("tensorwise")), losses(tmp_path / "two")
    assert b == pytest.approx(a, rel=2e-3)  # bf16 compute: reduction order moves the last bits
