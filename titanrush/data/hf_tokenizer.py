"""titanrush's BPE as a Hugging Face tokenizer (`tokenizer.json` + `tokenizer_config.json`).

A tiktoken rank file holds no merge list: tiktoken merges, within each pre-tokenized word, the adjacent
pair whose concatenation has the lowest rank. A Hugging Face BPE model applies merges in the order of
its merge list instead. Listing, for every multi-byte token, its splits into two tokens that both exist,
ordered by the merged token's rank, makes the two agree: the Hugging Face merge that fires first is the
pair whose result has the lowest rank, as in tiktoken. Bytes map to printable characters with GPT-2's
byte-level table, which Llama 3's `tokenizer.json` uses too.

`tokenizer_files` gives the files a Hugging Face export carries (`titanrush convert --to-hf`): the
training tokenizer as `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`, so that
`transformers.AutoTokenizer` loads it and encodes text as training did (BOS first, as Llama 3's does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titanrush.data.tokenizer import (
    DEFAULT_PATH,
    LLAMA3_PATTERN,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    load_ranks,
    special_tokens,
    tokenizer_path,
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE (printable bytes map to themselves)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list that reproduces tiktoken's merging of these ranks, first merge first.

    Args:
        ranks: token bytes -> rank (tiktoken's mergeable ranks).

    Returns:
        (left, right) pairs, sorted by the rank of `left + right`; among the splits of one token, by the
        larger rank of its two parts.
    """
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, max(ranks[left], ranks[right]), left, right))
    merges.sort()
    return [(left, right) for _, _, left, right in merges]


def hf_tokenizer_spec(ranks: dict[bytes, int], *, add_bos: bool = False) -> dict[str, Any]:
    """The `tokenizer.json` content for these ranks, Llama 3's pre-tokenizer and special tokens.

    Args:
        ranks: token bytes -> rank; the special tokens take the ids after the last rank.
        add_bos: encoding with special tokens puts BOS first (Llama 3's post-processor), as the training
            data frames every document.
    """
    enc = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(enc[b] for b in token)

    added = [
        {
            "id": len(ranks) + i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in enumerate(special_tokens())
    ]
    split = {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": _bos_template(len(ranks), special_tokens()[0]) if add_bos else None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(token): rank for token, rank in ranks.items()},
            "merges": [[text(left), text(right)] for left, right in bpe_merges(ranks)],
        },
    }


def _bos_template(bos_id: int, bos: str) -> dict[str, Any]:
    """A post-processor that puts BOS before each sequence (Llama 3's `TemplateProcessing`)."""
    piece = {"SpecialToken": {"id": bos, "type_id": 0}}
    first, second = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    return {
        "type": "TemplateProcessing",
        "single": [piece, first],
        "pair": [piece, first, piece, second],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def tokenizer_files(spec: str, max_len: int) -> tuple[dict[str, str], Tokenizer | HFTokenizer]:
    """The Hugging Face tokenizer files of the tokenizer `data.tokenizer = spec` names, and that tokenizer.

    A tiktoken rank file (the shipped BPE, Llama 3's tokenizer.model) becomes a `tokenizer.json` that puts
    BOS first; a `tokenizer.json` is carried unchanged, with its `tokenizer_config.json` and
    `special_tokens_map.json` where they lie beside it.

    Args:
        spec: `data.tokenizer`'s value ("default", a rank file, or a tokenizer.json or its folder).
        max_len: the model's longest sequence (`model_max_length` of a written tokenizer_config.json).

    Returns:
        (file name -> text, the tokenizer); the names are tokenizer.json, tokenizer_config.json and
        special_tokens_map.json.
    """
    tok = build_tokenizer(spec)
    bos, eos = tok.decode([tok.bos_id]), tok.decode([tok.eos_id])
    names = {"bos_token": bos, "eos_token": eos}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_len,
    }
    if isinstance(tok, HFTokenizer):
        files = {"tokenizer.json": tok.path.read_text()}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (tok.path.parent / name).exists():
                files[name] = (tok.path.parent / name).read_text()
    else:
        ranks, _ = load_ranks(tokenizer_path(spec))
        files = {"tokenizer.json": json.dumps(hf_tokenizer_spec(ranks, add_bos=True))}
        config.update(add_bos_token=True, add_eos_token=False)
    files.setdefault("tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    files.setdefault("special_tokens_map.json", json.dumps(names, indent=2) + "\n")
    return files, tok


def write_hf_tokenizer(folder: Path, rank_file: Path = DEFAULT_PATH) -> None:
    """Write a tiktoken rank file as a Hugging Face tokenizer into `folder`.

    Args:
        folder: created if missing; gets `tokenizer.json` and `tokenizer_config.json` (naming BOS and
            EOS, with no BOS added by the tokenizer itself).
        rank_file: the tiktoken rank file (default: titanrush's shipped BPE).
    """
    ranks, _ = load_ranks(rank_file)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(hf_tokenizer_spec(ranks)))
    specials = special_tokens()
    config = {"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
