"""What `titanrush convert --from-hf` prints leads, command by command as printed, to a run that trains,
saves a checkpoint and exports it, also for a Hugging Face model that ships no tokenizer."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
from test_hf import make_model, save_checkpoint

from titanrush import cli
from titanrush.data.tokenizer import build_tokenizer
from titanrush.interop import hf_convert
from titanrush.models.llama import model_args

# What a user's --config FILE holds for the run: a short CPU run on a few text files.
CONFIG = """
[training]
steps = 2
seq_len = 32
local_batch_size = 2

[data]
dataset = "files"
path = "corpus"
cache_dir = ""
"""


def hf_llama(folder: Path, vocab_size: int, tokenizer: str | None) -> Path:
    """A tiny Hugging Face Llama folder (the debug shape at `vocab_size`), with or without a tokenizer."""
    model = make_model(dataclasses.replace(model_args("debug"), vocab_size=vocab_size))
    ckpt = save_checkpoint(model, folder / "ck")
    return hf_convert.export_hf(ckpt, folder / "hf_llama", dtype=torch.float32, tokenizer=tokenizer)


def printed_commands(text: str) -> list[list[str]]:
    """The commands in the hint: its indented `titanrush ...` lines, as argv (without `titanrush`)."""
    lines = [line.strip() for line in text.splitlines() if line.startswith("  titanrush ")]
    return [shlex.split(line)[1:] for line in lines]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in tmp_path, with a text corpus and the user's config there (the hint's paths are relative)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(Path(json.__file__).read_text() * 3)
    (tmp_path / "config.toml").write_text(CONFIG)
    return tmp_path


def test_the_hint_for_a_model_without_a_tokenizer_trains_saves_and_exports(in_tmp, capsys):
    hf_llama(in_tmp, vocab_size=4096, tokenizer=None)
    assert not (in_tmp / "hf_llama" / "tokenizer.json").exists()
    capsys.readouterr()
    assert cli.main(["convert", "--from-hf", "hf_llama", "imported"]) == 0
    hint = capsys.readouterr().out
    tokenizer, train, export = printed_commands(hint)
    assert "hf_llama ships no tokenizer" in hint and "4096 ids" in hint
    assert tokenizer == ["tokenizer", "--vocab-size", "4096", "--output", "imported-tokenizer"]
    assert train[0] == "train" and "--checkpoint.enable" in train and "--config" not in train
    assert export[:2] == ["convert", "--to-hf"]

    # Without the tokenizer, the run's refusal points to the same command (not to a vocabulary the
    # imported weights do not have).
    without = train[: train.index("--data.tokenizer")] + train[train.index("--data.tokenizer") + 2 :]
    assert cli.main(without) == 2
    err = capsys.readouterr().err
    assert "use a tokenizer of at most 4096 ids" in err and "titanrush tokenizer --vocab-size 4096" in err
    assert "set model.vocab_size" not in err

    # As printed, with what the hint says to add: --input (your text) and --config FILE.
    assert cli.main([*tokenizer, "--input", "corpus"]) == 0
    assert build_tokenizer("imported-tokenizer").n_words <= 4096
    assert cli.main([*train, "--config", "config.toml"]) == 0, capsys.readouterr().err
    assert (in_tmp / "outputs" / "imported-train" / "checkpoint" / "step-2" / "titanrush.json").exists()
    capsys.readouterr()
    assert cli.main(export) == 0, capsys.readouterr().err
    exported = in_tmp / export[-1]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 4096


def test_the_hint_for_a_model_with_its_tokenizer_trains_with_it(in_tmp, capsys):
    """No tokenizer command then: the run reads the tokenizer.json the import carries."""
    pytest.importorskip(
        "tokenizers", reason="the run reads the import's tokenizer.json: pip install tokenizers"
    )
    hf_llama(in_tmp, vocab_size=8192, tokenizer="default")
    capsys.readouterr()
    assert cli.main(["convert", "--from-hf", "hf_llama", "imported"]) == 0
    hint = capsys.readouterr().out
    train, export = printed_commands(hint)
    assert "ships no tokenizer" not in hint
    assert train[train.index("--data.tokenizer") + 1] == str(Path("imported") / "tokenizer.json")
    assert cli.main([*train, "--config", "config.toml"]) == 0, capsys.readouterr().err
    assert cli.main(export) == 0, capsys.readouterr().err
    assert (in_tmp / export[-1] / "tokenizer.json").exists()
