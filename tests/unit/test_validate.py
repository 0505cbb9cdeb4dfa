"""titanrush.run.validate through build_plan: every numeric key has a range that is enforced, the rules
between keys, and the plan's checks against the mesh and the model, each a ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import pytest
import torch

from titanrush import config
from titanrush.config import ConfigError
from titanrush.run import validate
from titanrush.run.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]


def plan(*args: str, world: int = 1):
    return build_plan(config.load(None, list(args)), world)


def numeric_keys() -> list[str]:
    keys = []
    for section, cls in config.sections().items():
        hints = typing.get_type_hints(cls)
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]
    return keys


def test_every_numeric_key_has_a_range():
    assert sorted(numeric_keys()) == sorted(validate.RANGES)


def _outside(key: str) -> list[str]:
    """Values just outside the key's range (as the command line writes them)."""
    low, high, low_in, high_in = validate.RANGES[key]
    is_int = isinstance(low, int) and (high is None or isinstance(high, int))
    out = []
    if low is not None:
        out.append(low - 1 if is_int and low_in else low if not low_in else low - 1e-3)
    if high is not None:
        out.append(high + 1 if is_int and high_in else high if not high_in else high + 1e-3)
    return [str(v) for v in out]


@pytest.mark.parametrize("key", sorted(validate.RANGES))
def test_every_range_is_enforced_with_the_key_in_the_message(key):
    for value in _outside(key):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            plan(f"--{key}", value)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--optimizer.beta1", "1.0"], r"optimizer\.beta1 must be in \[0.0, 1.0\)"),
        (["--optimizer.beta2", "-0.1"], r"optimizer\.beta2 must be in"),
        (["--optimizer.eps", "0"], r"optimizer\.eps must be > 0.0"),
        (["--optimizer.weight_decay", "-0.1"], r"optimizer\.weight_decay must be >= 0.0"),
        (["--training.seed", "-1"], r"training\.seed must be in \[0, "),
        (["--training.seed", str(2**63)], r"training\.seed must be in"),
        (["--data.num_workers", "2", "--data.prefetch_factor", "0"], r"data\.prefetch_factor must be >= 1"),
        (["--training.local_batch_size", "100000000"], "tokens per micro-batch is beyond any GPU"),
        (["--training.steps", "0"], r"training\.steps must be >= 1"),
        (["--training.global_batch_size", "0"], "training.global_batch_size must be -1 or > 0"),
        (["--parallelism.dp_shard", "0"], "parallelism.dp_shard must be -1"),
        (["--activation_checkpoint.selective", "some"], "use 'op' or a positive integer"),
        (["--activation_checkpoint.selective", "²"], "use 'op' or a positive integer"),  # isdigit, not int
        (
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.op_all_last", "4"],
            "only applies to selective op checkpointing with op_matmuls = alternate",
        ),
        (["--parallelism.nccl_max_ctas", "65"], r"parallelism\.nccl_max_ctas must be in \[0, 64\]"),
        (["--model.flavor", "8b"], r"did you mean '8B'"),
        (["--float8.enable"], "float8.enable needs training.precision = 'bf16'"),
        (["--checkpoint.load_model_only"], "load_model_only applies to checkpoint.load_path"),
        (["--job.name", "n" * 256], r"job\.name: the name 'nnn.*has 256 bytes, past the 255"),
        (["--checkpoint.load_path", "/x/" + "é" * 128], r"checkpoint\.load_path: the name .* has 256 bytes"),
        (["--job.dump_folder", "/x" * 2048], r"job\.dump_folder: a path of 4,096 bytes"),
        (["--model.vocab_size", str(10**18)], r"a weight of model\.vocab_size x dim = 256,000,000,000"),
        (
            [
                "--model.flavor",
                "custom",
                "--model.dim",
                "256",
                "--model.n_heads",
                "8",
                "--model.vocab_size",
                "8192",
                "--model.n_layers",
                str(10**12),
            ],
            r"model\.n_layers = 1,000,000,000,000 is beyond any model",
        ),
        (["--profiling.freq", "3"], r"profiling\.freq \(3\) must be >= profiling.active_steps \+ 2"),
        (["--training.step_timeout", "0.5"], r"training\.step_timeout must be 0 .* or at least 1 second"),
        (["--moe.bias_update_rate", "0.02"], r"moe\.bias_update_rate applies to mixture-of-experts"),
        (
            ["--optimizer.name", "adamw8bit", "--optimizer.implementation", "foreach"],
            r"optimizer\.implementation = 'foreach' chooses torch's AdamW kernel",
        ),
        (
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "5"],
            r"activation_checkpoint\.selective = 5: the debug model has 4 blocks; use 1\.\.4",
        ),
        (["--parallelism.fsdp_keep_gathered_last", "10"], r"fsdp_keep_gathered_last = 10: .* use 0\.\.4"),
        (
            ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble", "--validation.freq", "5"],
            "Schedule.eval",
        ),
    ],
)
def test_value_rules(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        plan(*args)


@pytest.mark.parametrize(
    "world, args, pattern",
    [
        (4, ["--parallelism.tp", "3"], "do not divide the world size 4"),
        (4, ["--parallelism.dp_shard", "3"], r"dp_shard\(3\) x cp\(1\) x tp\(1\) x pp\(1\) = 3"),
        (2, ["--parallelism.tp", "2", "--training.loss", "chunked"], "chunked does not compose with"),
        (
            2,
            [
                "--parallelism.dp_replicate",
                "2",
                "--parallelism.dp_shard",
                "1",
                "--parallelism.tp",
                "1",
                "--parallelism.fsdp_cpu_offload",
            ],
            "fsdp_cpu_offload needs FSDP",
        ),
        (2, ["--parallelism.pp", "2", "--model.tie_embeddings", "tied"], "cannot tie the embedding"),
        (1, ["--activation_checkpoint.offload_first", "9"], "the debug model has 4 blocks"),
        (2, ["--training.global_batch_size", "6", "--training.local_batch_size", "4"], "multiple of"),
        (1, ["--training.seq_len", "4096"], "exceeds the debug model's maximum of 2048"),
        (1, ["--model.vocab_size", "100"], "does not cover the tokenizer"),
        (1, ["--compile.enable", "--experimental.async_tp"], r"async_tp needs parallelism.tp > 1 \(it fuses"),
        (2, ["--parallelism.tp", "2", "--experimental.async_tp"], r"needs compile.enable = true \("),
        (
            2,
            ["--parallelism.tp", "2", "--no-parallelism.sequence_parallel", "--experimental.async_tp"],
            "needs parallelism.sequence_parallel = true and compile.enable = true",
        ),
    ],
)
def test_run_rules(world, args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        plan(*args, world=world)


def test_machine_rules_on_cpu():
    for args, pattern in (
        (["--parallelism.cp", "2"], "needs CUDA GPUs"),
        (["--model.attn_backend", "flex"], "needs a CUDA GPU for training"),
        (["--training.precision", "bf16", "--float8.enable"], "float8 tensor cores"),
        (["--parallelism.tp", "2", "--compile.enable", "--experimental.async_tp"], "async_tp needs CUDA"),
    ):
        world = 2 if "--parallelism.cp" in args or "--parallelism.tp" in args else 1
        with pytest.raises(ConfigError, match=pattern):
            plan(*args, world=world)
        # ... and the estimator, which plans for another machine, skips them
        build_plan(config.load(None, args), world, machine=False)


@pytest.mark.parametrize("flavor", sorted(__import__("titanrush.models.llama", fromlist=["FLAVORS"]).FLAVORS))
def test_every_dense_flavor_plans(flavor):
    """Each built-in flavor's own arguments pass the model checks (on as many ranks as its size needs)."""
    build_plan(config.load(None, ["--model.flavor", flavor, "--training.seq_len", "64"]), 1, machine=False)


def test_every_llama4_flavor_plans():
    from titanrush.models.llama4 import FLAVORS as LLAMA4

    for flavor in LLAMA4:
        build_plan(
            config.load(None, ["--model.flavor", flavor, "--training.seq_len", "64"]), 1, machine=False
        )


@pytest.mark.parametrize("version, ok", [("2.11.0+cu130", True), ("2.11.1", True), ("2.13.0+cpu", False)])
def test_async_tp_is_refused_on_torch_versions_it_was_not_run_on(monkeypatch, version, ok):
    """The private option's lever runs only on the torch versions it was run on (the CUDA check passes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", version)
    cfg = config.load(None, ["--parallelism.tp", "2", "--compile.enable", "--experimental.async_tp"])
    if ok:
        validate.check_machine(cfg)
    else:
        with pytest.raises(ConfigError, match=f"was run on torch 2.11 only, not {re.escape(version)}"):
            validate.check_machine(cfg)


@pytest.mark.parametrize(
    "field, value",
    [
        ("norm_eps", float("nan")),
        ("norm_eps", 0.0),
        ("norm_eps", -1e-5),
        ("rope_theta", float("inf")),
        ("rope_theta", 0.0),
    ],
)
def test_model_numbers_from_anywhere_are_checked_once_resolved(field, value):
    """A model.from_checkpoint's config.json may hold what the config's ranges never see."""
    from titanrush.models.llama import model_args
    from titanrush.run.validate import check_model_args

    check_model_args(model_args("debug"))
    with pytest.raises(ConfigError, match=f"the model's {field} must be"):
        check_model_args(dataclasses.replace(model_args("debug"), **{field: value}))


@pytest.mark.parametrize(
    "steps, warmup, said",
    [
        (100, 100, "the learning rate reaches optimizer.lr only at the last step and never decays"),
        (100, 150, "the learning rate never reaches optimizer.lr (it ends at 67% of it) and never decays"),
        (1, 5, "never reaches optimizer.lr (it ends at 20% of it)"),
    ],
)
def test_a_warmup_as_long_as_the_run_is_a_warning(steps, warmup, said):
    cfg = config.load(None, ["--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup)])
    (message,) = validate.config_warnings(cfg)
    assert said in message and message.startswith(f"lr_scheduler.warmup_steps = {warmup} is not below")
    assert "set lr_scheduler.warmup_steps below training.steps" in message
    build_plan(cfg, 1)  # a warning, not an error
    assert validate.config_warnings(config.load(None, ["--training.steps", "100"])) == []


def test_the_warmup_warning_is_said_once_and_only_for_an_accepted_config(tmp_path, capsys):
    """`titanrush train --check` prints it before `config OK`; a run logs it once on stderr and trains on;
    a config error stays one line, without it."""
    from titanrush import cli

    argv = ["train", "--training.steps", "3", "--lr_scheduler.warmup_steps", "3"]
    argv += ["--data.dataset", "synthetic", "--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--job.dump_folder", str(tmp_path)]
    said = "lr_scheduler.warmup_steps = 3 is not below training.steps = 3"
    assert cli.main([*argv, "--check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and said in out[0] and out[0].startswith("warning: ") and out[1] == "config OK"
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err.count(said) == 1 and "step 3  loss" in out, err
    assert cli.main([*argv, "--model.vocab_size", "100"]) == 2
    assert said not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["cli", "toml"])
def test_an_integer_past_64_bits_is_refused_with_the_allowed_range(where, tmp_path):
    """`training.steps 99999999999999999999` used to pass: Python holds it, nothing the run counts with
    does. Every integer key without a bound of its own is held to a 64-bit integer."""
    huge = "99999999999999999999"
    if where == "cli":
        cfg = config.load(None, ["--training.steps", huge])
    else:
        (tmp_path / "c.toml").write_text(f"[training]\nsteps = {huge}\n")
        cfg = config.load(str(tmp_path / "c.toml"))
    with pytest.raises(
        ConfigError, match=re.escape(f"training.steps must be in [1, {2**63 - 1}], got {huge}")
    ):
        build_plan(cfg, 1)
    with pytest.raises(ConfigError, match=r"checkpoint\.interval must be in \[1, 9223372036854775807\]"):
        plan("--checkpoint.interval", huge)
    plan("--training.steps", str(2**63 - 1))  # (the largest is a setting)
    with pytest.raises(ConfigError, match=r"training\.steps must be >= 1, got 0$"):  # (below: as before)
        plan("--training.steps", "0")


def test_a_sequence_of_one_token_is_refused_with_the_reason():
    with pytest.raises(
        ConfigError, match=r"training\.seq_len must be >= 2, got 1: with one token per sequence"
    ):
        plan("--training.seq_len", "1")
    assert plan("--training.seq_len", "2").seq_len == 2


def test_a_bad_value_is_refused_before_torch_is_imported():
    """The trainer and the launcher check a config's values as soon as they have read it: one line and
    status 2 in a fraction of a second, torch never imported (validate.py and the flavors import without
    it)."""
    code = (
        "import sys\n"
        "from titanrush import train\n"
        "from titanrush.run import launch\n"
        "bad = ['--training.seq_len', '1']\n"
        "job = ['--standalone', '--nproc_per_node=2', '-m', 'titanrush.train', *bad]\n"
        "print(train.main([*bad, '--check']), launch.main(job), 'torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["2", "2", "False"], res.stdout + res.stderr
    said = "titanrush: config error: training.seq_len must be >= 2, got 1"
    assert [x[: len(said)] for x in res.stderr.splitlines()] == [said, said], res.stderr


def test_the_check_and_the_trainer_import_without_the_compiler_or_pipelining():
    """`--check` (the launcher forks it before every job) and the trainer's modules import neither dynamo
    nor torch's pipelining, a second of start-up each: a flash-attn run imports its operators, a pipelined
    run its schedules, and compile the compiler, when they are used. The check of the debug config runs
    without them."""
    code = (
        "import sys\n"
        "from titanrush import train, trainer\n"
        "status = train.main(['--check', '--job.dump_folder', sys.argv[1]])\n"
        "print(status, *(m in sys.modules for m in ('torch._dynamo', 'torch.distributed.pipelining')))\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(
            [sys.executable, "-c", code, tmp], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    assert res.stdout.split()[-3:] == ["0", "False", "False"], res.stdout + res.stderr
