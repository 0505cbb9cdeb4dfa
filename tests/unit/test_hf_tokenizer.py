"""Hugging Face tokenizers: the export of titanrush's BPE encodes text exactly as tiktoken does, and a
`tokenizer.json` trains like the rank file it came from (small stand-ins made in the tests: no downloads)."""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import regex

from titanrush.config import ConfigError
from titanrush.data.bpe import count_words, train_bpe
from titanrush.data.hf_tokenizer import bytes_to_unicode, tokenizer_files, write_hf_tokenizer
from titanrush.data.tokenizer import LLAMA3_PATTERN, HFTokenizer, build_tokenizer, special_tokens

NO_TOKENIZERS = "the tokenizers package is not installed: it is in [dev] (pip install -e '.[dev]')"
NO_TRANSFORMERS = "transformers is not installed: it is in [dev] (pip install -e '.[dev]')"

SAMPLES = [
    "def f(x):\n    return {'a': x ** 2}  # größer\n",
    "Hello, world! 1234567 tokens\t\tand   spaces\r\n\r\n",
    "日本語のテキストと emoji 🙂🚀, ÄÖÜ ß œ",
    (Path(json.__file__).parent / "decoder.py").read_text(),  # a real source file: thousands of merges
]


def hf_encode(spec: dict, text: str) -> list[int]:
    """Hugging Face's BPE as `tokenizer.json` specifies it: split, bytes to characters, merges by rank."""
    vocab, table = spec["model"]["vocab"], bytes_to_unicode()
    merge_rank = {tuple(m): i for i, m in enumerate(spec["model"]["merges"])}
    pattern = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    ids = []
    for word in regex.findall(pattern, text):
        parts = [table[b] for b in word.encode()]
        if "".join(parts) in vocab:  # ignore_merges: a whole word in the vocabulary is one token
            parts = ["".join(parts)]
        while len(parts) > 1:
            pairs = [(merge_rank.get(p, len(merge_rank)), i) for i, p in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == len(merge_rank):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [vocab[p] for p in parts]
    return ids


def test_merges_reproduce_tiktoken(tmp_path):
    write_hf_tokenizer(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    ours = build_tokenizer("default")
    assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == LLAMA3_PATTERN
    for text in SAMPLES:
        assert hf_encode(spec, text) == ours.encode(text, bos=False, eos=False)
    assert len(hf_encode(spec, SAMPLES[-1])) < len(SAMPLES[-1]) / 3  # merged, not a token per byte


def test_every_rank_once_and_special_ids(tmp_path):
    write_hf_tokenizer(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    ours = build_tokenizer("default")
    vocab = spec["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(ours.n_ranks))  # each rank exactly once
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    assert list(added) == special_tokens() and set(added.values()).isdisjoint(vocab.values())
    assert added["<|begin_of_text|>"] == ours.bos_id and added["<|end_of_text|>"] == ours.eos_id
    assert max(added.values()) == ours.n_words - 1
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")


# ----------------------------------------------------------------------------------------------
# A tokenizer.json as the training tokenizer (data.tokenizer), through the `tokenizers` package

CORPUS = [
    "the cat sat on the mat; the cat is fat and the mat is flat\n" * 3,
    "def add(a, b):\n    return a + b  # the sum of a and b\n" * 3,
    "Zahlen 1234 und größere Wörter, naïve café.\n" * 3,
]


def make_stand_in(folder: Path) -> tuple[Path, Path]:
    """A small Llama-3-layout tokenizer: (its tiktoken rank file, the folder of its tokenizer.json)."""
    ranks = train_bpe(count_words(CORPUS), 400)
    rank_file = folder / "small.tiktoken"
    ordered = sorted(ranks, key=ranks.__getitem__)
    rank_file.write_text("".join(f"{base64.b64encode(t).decode()} {ranks[t]}\n" for t in ordered))
    write_hf_tokenizer(folder / "hf", rank_file)
    return rank_file, folder / "hf"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> tuple[Path, Path]:
    return make_stand_in(tmp_path_factory.mktemp("stand_in"))


def test_tokenizer_json_trains_like_its_rank_file(stand_in):
    pytest.importorskip("tokenizers", reason=NO_TOKENIZERS)
    rank_file, folder = stand_in
    theirs, ours = build_tokenizer(str(folder / "tokenizer.json")), build_tokenizer(str(rank_file))
    assert isinstance(theirs, HFTokenizer) and not isinstance(ours, HFTokenizer)
    assert (theirs.n_words, theirs.n_ranks, theirs.bos_id, theirs.eos_id) == (
        ours.n_words,
        ours.n_ranks,
        ours.bos_id,
        ours.eos_id,
    )
    texts = [*SAMPLES, *CORPUS, "<|end_of_text|> inside a text stays text"]
    for text in texts:
        assert theirs.encode(text, bos=True, eos=True) == ours.encode(text, bos=True, eos=True)
        assert theirs.decode(theirs.encode(text, bos=False, eos=False)) == text
    assert theirs.encode_batch(texts, bos=True, eos=False) == ours.encode_batch(texts, bos=True, eos=False)
    assert [a.tolist() for a in theirs.encode_arrays(texts)] == [
        a.tolist() for a in ours.encode_arrays(texts)
    ]
    assert theirs.encode_arrays(texts)[0].dtype == np.uint32
    # The folder names the same tokenizer; its hash keys caches apart from the rank file's.
    assert build_tokenizer(str(folder)).hash == theirs.hash != ours.hash


def test_special_tokens_come_from_the_config_beside_the_file(stand_in, tmp_path):
    pytest.importorskip("tokenizers", reason=NO_TOKENIZERS)
    rank_file, folder = stand_in
    n = build_tokenizer(str(rank_file)).n_ranks  # the specials follow the ranks
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    default = build_tokenizer(str(tmp_path / "tokenizer.json"))  # no config: Llama 3's names
    assert (default.bos_id, default.eos_id) == (n, n + 1)
    # An instruct model's config ends a turn with <|eot_id|> (the 10th special token).
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>"})
    )
    eot = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert eot.eos_id == n + special_tokens().index("<|eot_id|>") and eot.hash != default.hash
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ConfigError, match=r"no EOS token \(<\|nope\|> not in its vocabulary\)"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def test_a_gpt2_style_tokenizer_json(tmp_path):
    """A tokenizer made by the `tokenizers` package itself (SmolLM-style: <|endoftext|> for BOS and EOS)."""
    tokenizers = pytest.importorskip("tokenizers", reason=NO_TOKENIZERS)
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(CORPUS, trainer)
    model.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path))
    assert tok.bos_id == tok.eos_id == model.token_to_id("<|endoftext|>") == 0
    ids = tok.encode("the cat sat", bos=True, eos=True)
    assert ids[0] == ids[-1] == 0 and len(ids) < 2 + len("the cat sat")
    assert tok.decode(ids[1:-1]) == "the cat sat"


def test_tokenizer_json_errors(tmp_path, monkeypatch):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": "not a tokenizer"}')
    if importlib.util.find_spec("tokenizers"):
        with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json") as e:
            build_tokenizer(str(bad))
        assert "data.tokenizer" in str(e.value)
        with pytest.raises(ConfigError, match="not found"):
            build_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="a folder without a tokenizer.json"):
        build_tokenizer(str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"needs the `tokenizers` package: pip install tokenizers"):
        build_tokenizer(str(bad))


def test_training_with_a_tokenizer_json(stand_in, tmp_path):
    pytest.importorskip("tokenizers", reason=NO_TOKENIZERS)
    from titanrush import config
    from titanrush.data import build_dataloader
    from titanrush.run.plan import build_plan
    from titanrush.trainer import Trainer

    _, folder = stand_in
    for i in range(6):
        (tmp_path / "corpus" / f"doc{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "corpus" / f"doc{i}.txt").write_text(CORPUS[i % 3] * (i + 1))
    tok = build_tokenizer(str(folder / "tokenizer.json"))
    argv = [
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "hf_tok",
        "--training.steps",
        "2",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--data.dataset",
        "files",
        "--data.path",
        str(tmp_path / "corpus" / "*.txt"),
        "--data.cache_dir",
        "",
        "--data.tokenizer",
        str(folder / "tokenizer.json"),
        "--model.vocab_size",
        str(tok.n_words),
    ]
    cfg = config.load(None, argv)
    loader = build_dataloader(cfg.data, tokenizer=tok, seq_len=32, local_batch_size=2, vocab_size=tok.n_words)
    batch = next(iter(loader))
    assert int(batch.input_ids.max()) < tok.n_words and tok.bos_id in batch.input_ids.flatten().tolist()
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        assert isinstance(trainer.tokenizer, HFTokenizer)
        losses = trainer.train()
    finally:
        trainer.close()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def write_files(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_exported_tokenizer_round_trips_text_through_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    files, ours = tokenizer_files("default", max_len=2048)
    assert sorted(files) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(write_files(tmp_path / "hf", files)))
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert theirs.model_max_length == 2048
    for text in SAMPLES:
        ids = theirs(text).input_ids
        assert ids == ours.encode(text, bos=True, eos=False)  # BOS first, as the training data has it
        assert theirs.decode(ids, skip_special_tokens=True) == text
    # Our own reader of tokenizer.json agrees too, with BOS/EOS from the exported config.
    again = build_tokenizer(str(tmp_path / "hf"))
    assert again.encode(SAMPLES[0], bos=True, eos=True) == ours.encode(SAMPLES[0], bos=True, eos=True)


def test_a_tokenizer_json_is_exported_as_it_is(stand_in, tmp_path):
    pytest.importorskip("tokenizers", reason=NO_TOKENIZERS)
    _, folder = stand_in
    files, tok = tokenizer_files(str(folder), max_len=64)
    assert files["tokenizer.json"] == (folder / "tokenizer.json").read_text()
    assert files["tokenizer_config.json"] == (folder / "tokenizer_config.json").read_text()
    names = json.loads(files["special_tokens_map.json"])  # written: the stand-in has none
    assert (names["bos_token"], names["eos_token"]) == (tok.decode([tok.bos_id]), tok.decode([tok.eos_id]))
