"""The tokenizers: byte-level BPE through tiktoken, or a Hugging Face `tokenizer.json`.

A rank file holds one `base64(token bytes) rank` pair per line (tiktoken's format, the format of the
Llama 3 `tokenizer.model`). The 256 special tokens follow the ranks, in Llama 3's order, so the shipped
7936-rank file gives 8192 ids and Llama 3's 128000-rank file gives 128256.

A `tokenizer.json` (any Hugging Face tokenizer: Llama 3's, SmolLM's, ...) is read through the `tokenizers`
package, imported only when one is named; its BOS and EOS come from the `tokenizer_config.json` beside it.
Both classes offer the same methods and attributes, which is all the data layer uses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
FOLDER_FILES = ("tokenizer.json", "tokenizer.model")
"""What `data.tokenizer` = a folder reads, the first that exists: a Hugging Face tokenizer.json, else a
tiktoken rank file named as Llama 3's (what `titanrush tokenizer` writes)."""


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
    fix = (
        "pass data.tokenizer = 'default', the path of a tiktoken rank file (e.g. Llama 3 tokenizer.model) "
        "or of a Hugging Face tokenizer.json"
    )
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if path == DEFAULT_PATH:
            fix = "rebuild it with `python scripts/build_tokenizer.py` (it writes the shipped file)"
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


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (through the `tokenizers` package) with Tokenizer's interface.

    Attributes:
        n_words: vocabulary size (the highest id + 1, added tokens included).
        bos_id, eos_id: the ids of the BOS and EOS tokens that `tokenizer_config.json` beside the file
            names (else Llama 3's, `<s>`/`</s>` or `<|endoftext|>`, whichever the vocabulary has).
        n_ranks: the size of the model's own vocabulary (ids below it are ordinary tokens in Llama 3's
            and titanrush's exports).
        spec: what `data.tokenizer` said.
        hash: hex digest of the file and the chosen BOS/EOS, to key caches and check shards.
    """

    def __init__(self, path: Path, *, spec: str) -> None:
        self.spec, self.path = spec, path
        fix = "pass data.tokenizer = a Hugging Face tokenizer.json (or its folder), a rank file or 'default'"
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(
                f"data.tokenizer = {spec!r} is a Hugging Face tokenizer.json, which needs the `tokenizers` "
                "package: pip install tokenizers (or pass a tiktoken rank file such as Llama 3's "
                "original/tokenizer.model)"
            ) from None
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"tokenizer file {str(path)!r} not found; {fix}") from None
        except OSError as e:
            raise ConfigError(f"tokenizer file {str(path)!r} cannot be read ({e.strerror}); {fix}") from None
        try:
            self.backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises its own exception types for a malformed file
            raise ConfigError(
                f"tokenizer file {str(path)!r} is not a Hugging Face tokenizer.json ({str(e)[:200]}); {fix}"
            ) from None
        # Special-token strings inside a text are encoded as ordinary text, as tiktoken's encode_ordinary
        # does: a document that mentions "<|end_of_text|>" must not end there.
        self.backend.encode_special_tokens = True
        bos, eos = _special_tokens_of(path, self.backend)
        self.bos_id, self.eos_id = self.backend.token_to_id(bos), self.backend.token_to_id(eos)
        self.n_words = max(self.backend.get_vocab(with_added_tokens=True).values()) + 1
        self.n_ranks = self.backend.get_vocab_size(with_added_tokens=False)
        self.hash = hashlib.sha256(raw + f"|{bos}|{eos}".encode()).hexdigest()

    def __repr__(self) -> str:
        return f"HFTokenizer(spec={self.spec!r}, n_words={getattr(self, 'n_words', None)})"

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text` (the tokenizer's own post-processing, e.g. an added BOS, not applied)."""
        return _framed(self.backend.encode(_valid(text), add_special_tokens=False).ids, bos, eos, self)

    def encode_batch(
        self, texts: Sequence[str], *, bos: bool, eos: bool, num_threads: int = 8
    ) -> list[list[int]]:
        """`encode` over many texts (the `tokenizers` package parallelizes a batch itself)."""
        batch = self.backend.encode_batch_fast([_valid(t) for t in texts], add_special_tokens=False)
        return [_framed(e.ids, bos, eos, self) for e in batch]

    def encode_arrays(self, texts: Sequence[str], *, num_threads: int = 8) -> list[np.ndarray]:
        """Token ids of each text as a uint32 array, without BOS/EOS."""
        batch = self.backend.encode_batch_fast([_valid(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in batch]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens as their strings)."""
        return self.backend.decode(list(ids), skip_special_tokens=False)


def _valid(text: str) -> str:
    """text without lone surrogates (Rust strings cannot hold them; tiktoken replaces them too)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _framed(ids: list[int], bos: bool, eos: bool, tok: HFTokenizer) -> list[int]:
    return ([tok.bos_id] if bos else []) + list(ids) + ([tok.eos_id] if eos else [])


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>")


def _special_tokens_of(path: Path, backend: Any) -> tuple[str, str]:
    """(BOS, EOS) token strings: `tokenizer_config.json` beside the file (else its older companion
    `special_tokens_map.json`), else a well-known pair."""
    named: dict[str, str] = {}
    for config in (path.parent / "tokenizer_config.json", path.parent / "special_tokens_map.json"):
        if not config.exists():
            continue
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{config} (beside data.tokenizer) is not valid JSON ({e})") from None
        for key in ("bos_token", "eos_token"):
            value = data.get(key) if isinstance(data, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                named.setdefault(key, value)
    found = []
    for key, fallbacks in (("bos_token", _BOS_NAMES), ("eos_token", _EOS_NAMES)):
        names = [named[key]] if key in named else list(fallbacks)
        token = next((n for n in names if backend.token_to_id(n) is not None), None)
        if token is None:
            raise ConfigError(
                f"tokenizer {str(path)!r} has no {key[:3].upper()} token ({' or '.join(names)} not in its "
                "vocabulary); put a tokenizer_config.json naming bos_token and eos_token beside it"
            )
        found.append(token)
    return found[0], found[1]


def tokenizer_path(spec: str) -> Path:
    """The file that `data.tokenizer` names: the shipped rank file, the file itself, or a folder's
    `tokenizer.json` (else its `tokenizer.model`, the rank file `titanrush tokenizer` writes)."""
    if not spec.strip():
        raise ConfigError("data.tokenizer is empty; pass 'default' or the path of a tokenizer file")
    path = DEFAULT_PATH if spec == "default" else Path(spec).expanduser()
    if path.is_dir():
        found = [path / name for name in FOLDER_FILES if (path / name).exists()]
        if not found:
            raise ConfigError(
                f"data.tokenizer = {spec!r} is a folder without a tokenizer.json or tokenizer.model; pass "
                "the tokenizer file itself (a tokenizer.json or a tiktoken rank file), or make one there "
                "with `titanrush tokenizer`"
            )
        path = found[0]
    if path.exists() and not path.is_file():  # (reading a pipe would wait for a writer forever)
        raise ConfigError(
            f"data.tokenizer = {spec!r} is not a regular file (a pipe or a device); pass a file"
        )
    return path


def build_tokenizer(spec: str) -> Tokenizer | HFTokenizer:
    """The tokenizer named by `data.tokenizer`.

    Args:
        spec: "default" (the shipped 8192-id BPE); the path of a tiktoken rank file such as the Llama 3
            `tokenizer.model` (128000 ranks; 128256 ids with the special tokens); or a Hugging Face
            `tokenizer.json` (a path ending in `.json`, or a folder holding one).

    Raises:
        ConfigError: the file is missing or malformed, or `tokenizers` is missing for a tokenizer.json.
    """
    path = tokenizer_path(spec)
    if path.suffix == ".json":
        return HFTokenizer(path, spec=spec)
    ranks, file_hash = load_ranks(path)
    return Tokenizer(ranks, spec=spec, file_hash=file_hash)
