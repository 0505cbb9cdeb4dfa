"""The Hugging Face export of titanrush's BPE encodes text exactly as tiktoken does."""

from __future__ import annotations

import json
from pathlib import Path

import regex

from titanrush.data.hf_tokenizer import bytes_to_unicode, write_hf_tokenizer
from titanrush.data.tokenizer import LLAMA3_PATTERN, build_tokenizer, special_tokens

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
