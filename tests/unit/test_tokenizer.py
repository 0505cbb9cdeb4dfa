"""The tokenizer: the shipped BPE, Llama 3 rank files, bad files, and the BPE trainer."""

from __future__ import annotations

import base64
import random
from collections import Counter
from pathlib import Path

import pytest
import regex

from titanrush.config import ConfigError
from titanrush.data import Tokenizer, build_tokenizer
from titanrush.data.bpe import count_words, train_bpe
from titanrush.data.tokenizer import DEFAULT_PATH, LLAMA3_PATTERN, special_tokens

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "Unicode: naïve café, 日本語, emoji 🙂, math ∑ ≠ ∞.\r\n\ttabs and    spaces   ",
    "",
    " ",
    "<|begin_of_text|> looks special but is plain text <|eot_id|>",
    "a" * 5000,
    "1234567890 12 345\n\n\n",
]


def write_ranks(path: Path, tokens: list[bytes]) -> Path:
    """A tiktoken rank file: token i gets rank i."""
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def llama3_sized_tokens() -> list[bytes]:
    """128000 unique tokens (all 256 single bytes first), the size of Llama 3's rank table."""
    return [bytes([i]) for i in range(256)] + [
        i.to_bytes(3, "big") for i in range(1 << 16, (1 << 16) + 127744)
    ]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer("default")


def test_default_vocabulary_layout(tok: Tokenizer) -> None:
    lines = DEFAULT_PATH.read_text().splitlines()
    assert DEFAULT_PATH.stat().st_size < 1_000_000
    assert tok.n_ranks == len(lines) == 7936
    assert tok.n_words == 8192
    specials = special_tokens()
    assert len(specials) == len(set(specials)) == 256
    # Llama 3 layout: the specials follow the ranks in this order.
    for offset, name in [
        (0, "<|begin_of_text|>"),
        (1, "<|end_of_text|>"),
        (9, "<|eot_id|>"),
        (10, "<|python_tag|>"),
    ]:
        assert tok.encoding.encode_single_token(name) == 7936 + offset
    assert tok.encoding.encode_single_token("<|reserved_special_token_2|>") == 7936 + 11
    assert tok.encoding.encode_single_token("<|reserved_special_token_246|>") == 8191
    assert (tok.bos_id, tok.eos_id) == (7936, 7937)


def test_default_is_a_real_bpe(tok: Tokenizer) -> None:
    text = (Path(regex.__file__)).read_text()  # real Python source that is not in the stdlib corpus
    ids = tok.encode(text, bos=False, eos=False)
    assert len(ids) < len(text.encode()) / 3  # merges, not bytes
    assert max(ids) < tok.n_ranks


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(i < tok.n_ranks for i in ids[1:-1])  # special-token text stays ordinary text
    assert tok.decode(ids[1:-1]) == text
    assert tok.encode(text, bos=False, eos=False) == ids[1:-1]


def test_batch_encoders_match_encode(tok: Tokenizer) -> None:
    batch = tok.encode_batch(SAMPLES, bos=True, eos=False)
    assert batch == [tok.encode(t, bos=True, eos=False) for t in SAMPLES]
    arrays = tok.encode_arrays(SAMPLES)
    assert [a.tolist() for a in arrays] == [tok.encode(t, bos=False, eos=False) for t in SAMPLES]


def test_tokens_never_cross_pretokenizer_words(tok: Tokenizer) -> None:
    text = "x = foo(bar, 42)\n    if self.y: return 'it''s'\n\n  done"
    cuts, pos = set(), 0
    for tid in tok.encode(text, bos=False, eos=False):
        pos += len(tok.encoding.decode_single_token_bytes(tid))
        cuts.add(pos)
    word_ends, pos = set(), 0
    for word in regex.findall(LLAMA3_PATTERN, text):
        pos += len(word.encode())
        word_ends.add(pos)
    assert word_ends <= cuts


def test_llama3_sized_rank_file_loads_unchanged(tmp_path: Path) -> None:
    path = write_ranks(tmp_path / "tokenizer.model", llama3_sized_tokens())
    tok = build_tokenizer(str(path))
    assert tok.n_words == 128256 and tok.n_ranks == 128000
    # Llama 3's published ids for its special tokens.
    assert tok.bos_id == 128000 and tok.eos_id == 128001
    assert tok.encoding.encode_single_token("<|start_header_id|>") == 128006
    assert tok.encoding.encode_single_token("<|eot_id|>") == 128009
    assert tok.decode(tok.encode("hello", bos=False, eos=False)) == "hello"
    assert tok.spec == str(path)


def test_trained_rank_file_loads(tmp_path: Path) -> None:
    ranks = train_bpe(count_words(["the cat sat on the mat; the cat is fat"] * 3), 300)
    path = write_ranks(tmp_path / "small.tiktoken", sorted(ranks, key=ranks.get))
    tok = build_tokenizer(str(path))
    assert tok.n_words == len(ranks) + 256
    ids = tok.encode("the cat", bos=False, eos=False)
    assert len(ids) < len(b"the cat")
    assert tok.decode(ids) == "the cat"


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"not base64!! 0\n", "line 1"),
        (b"\x08\x01\x12\x03\xff\xfe protobuf-like", "not a tiktoken rank file"),
        (b"", "empty"),
        (b"YQ== 0\nYQ== 1\n", "duplicate"),
        (b"YQ== 0\nYg== 5\n", "ranks"),
        (b"YQ== 0\nYg== 1\n", "single-byte"),
    ],
)
def test_corrupt_rank_file(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "bad.model"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=needle) as e:
        build_tokenizer(str(path))
    assert str(path) in str(e.value) and "data.tokenizer" in str(e.value)


def test_missing_rank_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(ConfigError, match="not found") as e:
        build_tokenizer(str(path))
    assert str(path) in str(e.value) and "data.tokenizer" in str(e.value)


# ----------------------------------------------------------------------------------------------
# The BPE trainer


def naive_bpe(word_counts: dict[bytes, int], n_ranks: int) -> dict[bytes, int]:
    """Reference trainer: recount every pair before every merge."""
    token_bytes = [bytes([i]) for i in range(256)]
    ranks = {b: i for i, b in enumerate(token_bytes)}
    words = {tuple(w): c for w, c in word_counts.items()}
    while len(ranks) < n_ranks:
        pairs: Counter[tuple[int, int]] = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        pair = min(pairs, key=lambda p: (-pairs[p], p))
        merged = token_bytes[pair[0]] + token_bytes[pair[1]]
        if merged not in ranks:
            ranks[merged] = len(token_bytes)
            token_bytes.append(merged)
        new_id = ranks[merged]
        new_words: Counter[tuple[int, ...]] = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = dict(new_words)
    return ranks


def test_incremental_bpe_matches_naive() -> None:
    rng = random.Random(0)
    vocab = ["the", "there", "then", "cat", "catalog", "  ", "    ", "aaaa", "abab", "ba", "ab", "é", "日本"]
    vocab += ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 9))) for _ in range(200)]
    text = " ".join(rng.choice(vocab) for _ in range(5000))
    words = count_words([text])
    fast = train_bpe(words, 256 + 200)
    assert fast == naive_bpe(words, 256 + 200)
    assert len(fast) == 256 + 200
    assert sorted(fast.values()) == list(range(len(fast)))


def test_bpe_stops_when_pairs_run_out() -> None:
    ranks = train_bpe({b"ab": 5}, 1000)
    assert ranks[b"ab"] == 256 and len(ranks) == 257
