"""The tokenizer: byte-level BPE through tiktoken, with the Llama 3 pre-tokenizer and special tokens.

A rank file holds one `base64(token bytes) rank` pair per line (tiktoken's format, the format of the
Llama 3 `tokenizer.model`). The 256 special tokens follow the ranks, in Llama 3's order, so the shipped
7936-rank file gives 8192 ids and Llama 3's 128000-rank file gives 128256.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tiktoken

from titanrush.config import ConfigError

DEFAULT_PATH = Path(__file__).parent / "assets" / "titanrush_bpe.tiktoken"
"""The shipped rank file, built by `scripts/build_tokenizer.py`."""

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenizer regex: text is split into words, and BPE never merges across words."""

NUM_SPECIAL_TOKENS = 256


def special_tokens() -> list[str]:
    """The 256 special tokens in Llama 3's order (ids follow the last BPE rank)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    return named + [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL_TOKENS - len(named))]


class Tokenizer:
    """Byte-level BPE tokenizer (tiktoken) with BOS/EOS and the Llama 3 special tokens.

    Attributes:
        n_words: vocabulary size (BPE ranks + special tokens).
        bos_id: id of `<|begin_of_text|>`.
        eos_id: id of `<|end_of_text|>`.
        n_ranks: number of BPE ranks (ids below this are ordinary tokens).
        spec: what `data.tokenizer` said ("default" or a path).
        hash: hex digest of the rank file, to key caches and check pre-tokenized shards.
    """

    def __init__(self, ranks: dict[bytes, int], *, spec: str, file_hash: str) -> None:
        self.n_ranks = len(ranks)
        self.special_ids = {tok: self.n_ranks + i for i, tok in enumerate(special_tokens())}
        self.n_words = self.n_ranks + len(self.special_ids)
        self.bos_id = self.special_ids["<|begin_of_text|>"]
        self.eos_id = self.special_ids["<|end_of_text|>"]
        self.spec = spec
        self.hash = file_hash
        self.encoding = tiktoken.Encoding(
            name=f"titanrush-{file_hash[:12]}",
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_ids,
            explicit_n_vocab=self.n_words,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(spec={self.spec!r}, n_words={self.n_words})"

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`; special-token strings inside it are encoded as ordinary text.

        Args:
            text: the text to encode.
            bos: prepend the BOS id.
            eos: append the EOS id.
        """
        ids = self.encoding.encode_ordinary(text)
        return self._frame(ids, bos, eos)

    def encode_batch(
        self, texts: Sequence[str], *, bos: bool, eos: bool, num_threads: int = 8
    ) -> list[list[int]]:
        """`encode` over many texts with tiktoken's multi-threaded batch encoder."""
        batch = self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)
        return [self._frame(ids, bos, eos) for ids in batch]

    def encode_arrays(self, texts: Sequence[str], *, num_threads: int = 8) -> list[np.ndarray]:
        """Token ids of each text as a uint32 array, without BOS/EOS; threads encode texts in parallel.

        The fast path for corpora: tiktoken fills a buffer without building Python lists.
        """
        if num_threads <= 1 or len(texts) <= 1:
            return [self._encode_array(t) for t in texts]
        with ThreadPoolExecutor(num_threads) as pool:
            return list(pool.map(self._encode_array, texts))

    def _encode_array(self, text: str) -> np.ndarray:
        try:
            return self.encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates: tiktoken's list path repairs them
            return np.asarray(self.encoding.encode_ordinary(text), dtype=np.uint32)

    def _frame(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens as their strings; broken UTF-8 sequences replaced)."""
        return self.encoding.decode(list(ids))


def load_ranks(path: Path) -> tuple[dict[bytes, int], str]:
    """Read a tiktoken rank file: (token bytes -> rank, sha256 hex of the file).

    Raises:
        ConfigError: naming the file and the fix when it is missing or not a valid rank file.
    """
    fix = "pass data.tokenizer = 'default' or the path of a tiktoken rank file (e.g. Llama 3 tokenizer.model)"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if path == DEFAULT_PATH:
            fix = "rebuild it with `python scripts/build_tokenizer.py`"
        raise ConfigError(f"tokenizer file {str(path)!r} not found; {fix}") from None
    except OSError as e:
        raise ConfigError(f"tokenizer file {str(path)!r} cannot be read ({e.strerror}); {fix}") from None
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(
            f"tokenizer file {str(path)!r} is not a tiktoken rank file (it is not text; SentencePiece "
            f"models are not supported); {fix}"
        ) from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"tokenizer file {str(path)!r} is not a tiktoken rank file (bad entry at line {lineno}; "
                f"expected '<base64 token> <rank>'); {fix}"
            ) from None
    if not ranks:
        raise ConfigError(f"tokenizer file {str(path)!r} is empty; {fix}")
    problem = _check_ranks(ranks, n_lines=sum(1 for line in lines if line))
    if problem:
        raise ConfigError(f"tokenizer file {str(path)!r} is corrupt: {problem}; {fix}")
    return ranks, hashlib.sha256(raw).hexdigest()


def _check_ranks(ranks: dict[bytes, int], n_lines: int) -> str:
    """What is wrong with a rank table ("" when nothing): tiktoken needs ranks 0..n-1 over unique
    tokens that include all 256 single bytes."""
    if len(ranks) != n_lines:
        return f"{n_lines - len(ranks)} duplicate token(s)"
    if sorted(ranks.values()) != list(range(len(ranks))):
        return "ranks are not 0..n-1 without gaps or repeats"
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        return f"{len(missing)} of the 256 single-byte tokens are missing (e.g. byte {missing[0]})"
    return ""


def build_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `data.tokenizer`.

    Args:
        spec: "default" (the shipped 8192-id BPE) or the path of a tiktoken rank file such as
            the Llama 3 `tokenizer.model` (128000 ranks; 128256 ids with the special tokens).

    Raises:
        ConfigError: the file is missing or is not a valid rank file.
    """
    path = DEFAULT_PATH if spec == "default" else Path(spec).expanduser()
    ranks, file_hash = load_ranks(path)
    return Tokenizer(ranks, spec=spec, file_hash=file_hash)
