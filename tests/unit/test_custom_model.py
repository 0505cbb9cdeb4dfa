"""Custom model shapes: `model.flavor = "custom"` with [model] dimensions or `model.from_checkpoint`, their
rules, and continued pretraining of a converted Hugging Face Llama in the one command `convert` prints."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path

import pytest
import torch
from test_hf import NO_TRANSFORMERS, assert_same_state, make_model, save_checkpoint, trainer_weights
from test_hf_tokenizer import CORPUS, make_stand_in

from titanrush import config, train
from titanrush.config import ConfigError
from titanrush.interop import hf, hf_convert
from titanrush.models.llama import FLAVORS, ModelArgs
from titanrush.models.llama.flavors import shape_of
from titanrush.run.plan import build_plan
from titanrush.tools import convert, generate

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2"]


def args_of(*argv: str) -> ModelArgs:
    return build_plan(config.load(None, [*SMALL, *argv]), 1).args


def shape(args: ModelArgs) -> dict[str, object]:
    """The shape, the FFN by its width (Hugging Face states the width; its two Meta factors are chosen)."""
    return {**shape_of(args), "multiple_of": None, "ffn_dim_multiplier": None, "ffn_hidden": args.ffn_hidden}


def test_custom_shape_from_the_model_keys():
    args = args_of(
        "--model.flavor",
        "custom",
        "--model.dim",
        "96",
        "--model.n_layers",
        "3",
        "--model.n_heads",
        "6",
        "--model.n_kv_heads",
        "2",
        "--model.vocab_size",
        "8192",
        "--model.ffn_hidden",
        "250",
        "--model.rope_theta",
        "10000",
        "--model.norm_eps",
        "1e-6",
        "--model.max_seq_len",
        "512",
        "--model.tie_embeddings",
        "tied",
    )
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (96, 3, 6, 2, 8192)
    assert args.ffn_hidden == 250  # exactly, as Hugging Face's intermediate_size states it
    assert (args.rope_theta, args.norm_eps, args.max_seq_len, args.tie_embeddings) == (1e4, 1e-6, 512, True)
    assert not args.rope_scaling and args.rope_positions == 32  # the run's sequence, as for any flavor
    meta = args_of(
        "--model.flavor",
        "custom",
        "--model.dim",
        "96",
        "--model.n_layers",
        "3",
        "--model.n_heads",
        "6",
        "--model.vocab_size",
        "8192",
        "--model.multiple_of",
        "32",
        "--model.ffn_dim_multiplier",
        "1.5",
        "--model.rope_scaling",
        "llama3",
        "--model.rope_scale_factor",
        "16",
    )
    assert meta.ffn_hidden == 32 * math.ceil(int(1.5 * int(8 * 96 / 3)) / 32)  # Meta's sizing
    assert meta.kv_heads == 6 and meta.rope_scaling and meta.rope_scale_factor == 16
    assert meta.rope_low_freq_factor == ModelArgs().rope_low_freq_factor  # the rest: Llama 3.1's defaults


def hf_folder(args: ModelArgs, folder: Path, tokenizer: str | None = None, seed: int = 0) -> Path:
    """An HF Llama folder of a random model with these arguments (written through titanrush's export)."""
    model = make_model(args, seed=seed)
    ckpt = save_checkpoint(model, folder / "src" / "checkpoint")
    return hf_convert.export_hf(ckpt, folder / "hf", dtype=torch.float32, tokenizer=tokenizer)


# Llama 3.1's layout (llama3 RoPE scaling, GQA, untied) and SmolLM's (tied, 3 query heads per K/V head,
# RoPE theta 1e4, a small vocabulary), both shrunk.
LLAMA31_LIKE = ModelArgs(
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=8320,
    multiple_of=64,
    ffn_dim_multiplier=1.3,
    rope_scaling=True,
    rope_original_max_len=64,
    max_seq_len=256,
)
SMOL_LIKE = ModelArgs(
    dim=96,
    n_layers=2,
    n_heads=3,
    n_kv_heads=1,
    vocab_size=8192,
    multiple_of=256,
    rope_theta=10000.0,
    tie_embeddings=True,
    max_seq_len=128,
)


@pytest.mark.parametrize("source", [LLAMA31_LIKE, SMOL_LIKE], ids=["llama31_like", "smol_like"])
def test_from_checkpoint_takes_every_shape_field(tmp_path, source):
    out = hf_folder(source, tmp_path, tokenizer="default")
    imported = hf_convert.import_hf(out, tmp_path / "imported")
    for path in (out, out / "config.json", imported, imported / "titanrush.json"):
        args = args_of("--model.flavor", "custom", "--model.from_checkpoint", str(path))
        assert shape(args) == shape(source), path
    # A converted checkpoint's run has exactly the recorded arguments (what checkpoint loading compares).
    recorded = json.loads((imported / "titanrush.json").read_text())["model_args"]
    assert shape_of(args) == {k: recorded[k] for k in shape_of(args)}
    # Keys that are set override the checkpoint's fields, the rest stay.
    longer = args_of(
        "--model.flavor",
        "custom",
        "--model.from_checkpoint",
        str(out),
        "--model.max_seq_len",
        "4096",
        "--model.rope_theta",
        "1e6",
        "--model.vocab_size",
        "9000",
    )
    assert shape(longer) == {**shape(source), "max_seq_len": 4096, "rope_theta": 1e6, "vocab_size": 9000}


def test_a_trainer_checkpoint_gives_its_shape(tmp_path):
    run = train.main(
        [
            "--job.dump_folder",
            str(tmp_path),
            "--job.name",
            "base",
            *SMALL,
            "--checkpoint.enable",
            "--model.flavor",
            "custom",
            "--model.dim",
            "64",
            "--model.n_layers",
            "2",
            "--model.n_heads",
            "2",
            "--model.vocab_size",
            "8192",
        ]
    )
    assert run == 0
    info = json.loads((tmp_path / "base" / "checkpoint" / "step-2" / "titanrush.json").read_text())
    assert info["flavor"] == "custom" and info["model_args"]["dim"] == 64
    args = args_of(
        "--model.flavor", "custom", "--model.from_checkpoint", str(tmp_path / "base" / "checkpoint")
    )
    assert (args.dim, args.n_layers, args.n_heads) == (64, 2, 2)
    assert args.attn_backend == "sdpa" and args.rope_positions == 32  # the run's, not the checkpoint's


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--model.dim", "64"], r"model\.dim applies to model\.flavor = 'custom' \(this run uses 'debug'"),
        (["--model.rope_scaling", "none"], r"model\.rope_scaling applies to model\.flavor = 'custom'"),
        (["--model.from_checkpoint", "x"], r"set model\.flavor = 'custom' \(not 'debug'\)"),
        (["--model.flavor", "Custom"], r"did you mean 'custom'"),
        (
            ["--model.flavor", "custom", "--model.dim", "64"],
            r"model\.n_layers, model\.n_heads, model\.vocab_size",
        ),
        (
            ["--model.flavor", "custom", "--model.from_checkpoint", "/no/such/folder"],
            r"model\.from_checkpoint = '/no/such/folder': .*does not exist",
        ),
    ],
    ids=[
        "dim_on_a_flavor",
        "rope_on_a_flavor",
        "from_checkpoint_on_a_flavor",
        "typo",
        "missing_keys",
        "missing_checkpoint",
    ],
)
def test_model_key_rules(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        args_of(*argv)


CUSTOM = ["--model.flavor", "custom", "--model.n_layers", "2", "--model.vocab_size", "8192"]


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (
            ["--model.dim", "100", "--model.n_heads", "3"],
            r"model\.dim \(100\) must be divisible by model\.n_heads",
        ),
        (
            ["--model.dim", "96", "--model.n_heads", "4", "--model.n_kv_heads", "3"],
            r"model\.n_heads \(4\) must be a multiple of model\.n_kv_heads \(3\)",
        ),
        (["--model.dim", "36", "--model.n_heads", "4"], r"model\.dim / model\.n_heads = 9 must be even"),
        (
            [
                "--model.dim",
                "64",
                "--model.n_heads",
                "2",
                "--model.ffn_hidden",
                "128",
                "--model.multiple_of",
                "64",
            ],
            r"model\.ffn_hidden sets the SwiGLU width exactly",
        ),
        (
            [
                "--model.dim",
                "64",
                "--model.n_heads",
                "2",
                "--model.rope_scaling",
                "none",
                "--model.rope_scale_factor",
                "4",
            ],
            r"model\.rope_scale_factor applies to model\.rope_scaling = 'llama3'",
        ),
        (
            [
                "--model.dim",
                "64",
                "--model.n_heads",
                "2",
                "--model.rope_scaling",
                "llama3",
                "--model.rope_low_freq_factor",
                "4",
                "--model.rope_high_freq_factor",
                "2",
            ],
            r"0 < rope_low_freq_factor \(4.0\) <= rope_high_freq_factor \(2.0\)",
        ),
        (
            ["--model.dim", "64", "--model.n_heads", "2", "--model.vocab_size", "100"],
            r"model vocabulary \(100\) does not cover the tokenizer's 8192",
        ),
    ],
    ids=["heads", "kv_heads", "odd_head_dim", "ffn_twice", "rope_none", "rope_factors", "vocab"],
)
def test_custom_shape_rules(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        args_of(*CUSTOM, *argv)


def test_the_command_line_refuses_before_building(tmp_path, capsys):
    argv = [
        "--check",
        "--job.dump_folder",
        str(tmp_path),
        *CUSTOM,
        "--model.dim",
        "100",
        "--model.n_heads",
        "3",
    ]
    assert train.main(argv) == 2
    assert "must be divisible by model.n_heads" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["smol_like", "llama31_like"])
def test_continued_pretraining_of_a_converted_llama_in_one_command(tmp_path, capsys, kind):
    """A Hugging Face folder with its own tokenizer.json (SmolLM-style: a small BPE of its own, tied;
    Llama-3.1-style: llama3 RoPE, untied, a vocabulary larger than the tokenizer's): `convert --from-hf`,
    then the printed command (plus a dataset and a step count) trains from exactly its weights."""
    pytest.importorskip("tokenizers", reason=NO_TRANSFORMERS)
    if kind == "smol_like":
        _, tokenizer = make_stand_in(tmp_path)
        source_args = dataclasses.replace(SMOL_LIKE, vocab_size=704)  # the stand-in's few hundred ids, padded
    else:
        tokenizer, source_args = "default", LLAMA31_LIKE
    model = make_model(source_args, seed=5)
    source = hf_convert.export_hf(
        save_checkpoint(model, tmp_path / "src"), tmp_path / "hf_model", torch.float32, str(tokenizer)
    )
    assert convert.main(["--from-hf", str(source), str(tmp_path / "ckpt")]) == 0
    (train,) = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("  titanrush train ")
    ]
    flags = shlex.split(train)[2:]
    assert "--data.tokenizer" in flags  # the HF folder's tokenizer came along
    at = flags.index("--job.dump_folder")  # (the printed run folder, outputs/...: this test names its own)
    assert flags[at + 2] == "--job.name"
    flags = flags[:at] + flags[at + 4 :]
    (tmp_path / "corpus").mkdir()
    for i, text in enumerate(CORPUS * 2):
        (tmp_path / "corpus" / f"{i}.txt").write_text(text)
    argv = [
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "cpt",
        *SMALL,
        "--data.dataset",
        "files",
        "--data.path",
        str(tmp_path / "corpus" / "*.txt"),
        "--data.cache_dir",
        "",
        "--checkpoint.enable",
        *flags,
    ]
    from titanrush.trainer import Trainer

    cfg = config.load(None, argv)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        assert shape(trainer.plan.args) == shape(source_args)
        assert_same_state({k: v.float() for k, v in trainer_weights(trainer).items()}, model.state_dict())
        losses = trainer.train()
    finally:
        trainer.close()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # The run's own checkpoint records the custom shape, and generate reads it with the run's tokenizer.
    step = tmp_path / "cpt" / "checkpoint" / "step-2"
    assert json.loads((step / "titanrush.json").read_text())["flavor"] == "custom"
    assert Path(hf.training_tokenizer(step)) == (tmp_path / "ckpt" / "tokenizer.json").resolve()
    capsys.readouterr()  # (the run's own progress lines, on stdout)
    assert generate.main(["--checkpoint", str(step), "--prompt", "the cat", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


def test_every_flavor_is_reachable_as_a_custom_shape(tmp_path):
    """What a flavor is, a custom shape can say: the flavors are shorthands, not the only shapes."""
    for name in ("1B", "8B"):
        (tmp_path / f"{name}.json").write_text(json.dumps(hf.hf_config(FLAVORS[name])))
        args = build_plan(
            config.load(
                None, ["--model.flavor", "custom", "--model.from_checkpoint", str(tmp_path / f"{name}.json")]
            ),
            1,
            machine=False,
        ).args
        assert shape_of(args) == shape_of(FLAVORS[name]) and hf.flavor_of(args) == name


def test_transformers_reads_a_custom_shape_export(tmp_path):
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    out = hf_folder(SMOL_LIKE, tmp_path, tokenizer="default", seed=9)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    ours = make_model(SMOL_LIKE, seed=9)
    tokens = torch.randint(0, SMOL_LIKE.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)
