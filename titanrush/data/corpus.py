"""Tokenized corpora: documents as token ranges, and the infinite token stream read from them.

Every document is stored framed as `BOS tokens... EOS`. A `TokenCorpus` comes either from text
(tokenized at start-up, cached on disk) or from the shards that `titanrush prepare` wrote (memory
mapped). A `TokenStream` concatenates the documents, epoch after epoch, each epoch in a seeded
order, and reads any token range of that endless stream by position.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titanrush.config import ConfigError
from titanrush.data.sources import Document
from titanrush.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
SHARD_FORMAT = "titanrush-shards"
SHARD_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab < 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


@dataclass
class TokenCorpus:
    """Documents as token ranges: document i is `arrays[doc_array[i]][doc_start[i]:][:doc_len[i]]`.

    Attributes:
        arrays: token arrays (one in-memory array, or one memory map per shard).
        doc_array: (N,) int32, which array holds each document.
        doc_start: (N,) int64, where it starts there.
        doc_len: (N,) int64, its length in tokens (BOS and EOS included).
        names: a name per array for error messages (the shard file).
        bos_id: the BOS id that starts every document.
    """

    arrays: list[np.ndarray]
    doc_array: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    names: list[str]
    bos_id: int

    @property
    def n_tokens(self) -> int:
        """Tokens in one epoch."""
        return int(self.doc_len.sum())

    def __getstate__(self) -> dict:
        # Loader workers started with spawn get the shard paths, not copies of the shards.
        state = self.__dict__.copy()
        state["arrays"] = [
            (n, a.dtype.str) if isinstance(a, np.memmap) else a for n, a in zip(self.names, self.arrays)
        ]
        return state

    def __setstate__(self, state: dict) -> None:
        state["arrays"] = [
            np.memmap(a[0], dtype=a[1], mode="r") if isinstance(a, tuple) else a for a in state["arrays"]
        ]
        self.__dict__.update(state)


# ----------------------------------------------------------------------------------------------
# From text


def tokenize_documents(
    docs: Iterable[Document], tokenizer: Tokenizer, chunk_chars: int = 1 << 25
) -> TokenCorpus:
    """Tokenize documents (in chunks of about `chunk_chars`, with tiktoken's threads) into a corpus."""
    dtype = token_dtype(tokenizer.n_words)
    parts: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for chunk in _chunks(docs, chunk_chars):
        encoded = tokenizer.encode_arrays([d.text for d in chunk], num_threads=min(8, os.cpu_count() or 1))
        part, lens = frame(encoded, tokenizer.bos_id, tokenizer.eos_id, dtype)
        parts.append(part)
        lengths.append(lens)
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype)
    doc_len = np.concatenate(lengths) if lengths else np.empty(0, np.int64)
    return in_memory_corpus(tokens, doc_len, "tokenized text", tokenizer.bos_id)


def frame(encoded: list[np.ndarray], bos: int, eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token arrays as `BOS ids EOS` documents: (tokens, per-document lengths)."""
    lens = np.fromiter((len(a) + 2 for a in encoded), dtype=np.int64, count=len(encoded))
    out = np.empty(int(lens.sum()), dtype)
    pos = 0
    for a in encoded:
        out[pos] = bos
        out[pos + 1 : pos + 1 + len(a)] = a
        out[pos + 1 + len(a)] = eos
        pos += len(a) + 2
    return out, lens


def in_memory_corpus(tokens: np.ndarray, doc_len: np.ndarray, name: str, bos_id: int) -> TokenCorpus:
    """A corpus over one token array holding the documents back to back."""
    doc_len = doc_len.astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(doc_len)[:-1]]).astype(np.int64) if len(doc_len) else doc_len
    return TokenCorpus([tokens], np.zeros(len(doc_len), np.int32), starts, doc_len, [name], bos_id)


def _chunks(docs: Iterable[Document], chunk_chars: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc.text)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def cache_key(tokenizer: Tokenizer, what: str, files: list[Path]) -> str:
    """Identity of a tokenized corpus: tokenizer hash, what was read and how, and each file's
    path, size and modification time (so an edited file makes a new key)."""
    h = hashlib.sha256(f"v1|{tokenizer.hash}|{what}".encode())
    for path in files:
        st = path.stat()
        h.update(f"|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def cached_corpus(
    key: str, cache_dir: str, build: Callable[[], TokenCorpus], tokenizer: Tokenizer, label: str
) -> TokenCorpus:
    """The corpus cached under `key` in `cache_dir`, or `build()` (then cached when possible).

    A missing, stale or unreadable cache entry is rebuilt; an unwritable cache dir only costs the
    next start-up the tokenization again.
    """
    path = Path(cache_dir).expanduser() / f"tokens-{key[:32]}.npz" if cache_dir else None
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as f:
                if str(f["key"]) == key and int(f["doc_len"].sum()) == len(f["tokens"]):
                    logger.info("%s: tokens from cache %s", label, path)
                    return in_memory_corpus(f["tokens"], f["doc_len"], label, tokenizer.bos_id)
        except Exception as e:  # a truncated or foreign file: rebuild it
            logger.warning("%s: ignoring unreadable cache %s (%s)", label, path, e)
    where = f"; cached in {path} for the next start" if path is not None else ""
    logger.info("%s: tokenizing the documents (once: a first start takes a while%s)", label, where)
    t0 = time.perf_counter()
    corpus = build()
    logger.info("%s: %d tokens in %.1f s", label, corpus.n_tokens, time.perf_counter() - t0)
    if path is not None:
        _write_cache(path, key, corpus)
    return corpus


def _write_cache(path: Path, key: str, corpus: TokenCorpus) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, key=np.array(key), tokens=corpus.arrays[0], doc_len=corpus.doc_len)
            os.replace(tmp, path)  # atomic: concurrent ranks never see a half-written file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        logger.warning(
            "cannot write the token cache %s (%s); set data.cache_dir to a writable folder", path, e
        )


# ----------------------------------------------------------------------------------------------
# From shards


def load_shards(path: str, split: str, tokenizer: Tokenizer, vocab_size: int | None) -> TokenCorpus:
    """Memory-map the `split` shards that `titanrush prepare` wrote to the folder `path`.

    Raises:
        ConfigError: naming the file, when the index or a shard is missing or inconsistent, was made
            with another tokenizer, or holds ids that do not fit `vocab_size`.
    """
    folder = Path(path).expanduser()
    index_path = folder / INDEX_FILE if folder.is_dir() or not folder.suffix else folder
    folder = index_path.parent
    fix = f"write shards with `titanrush prepare --input GLOB --output {folder}`"
    if not index_path.is_file():
        raise ConfigError(f"data.path = {path!r}: {index_path} not found; {fix}")
    try:
        index = json.loads(index_path.read_text())
        assert index["format"] == SHARD_FORMAT, "not a titanrush shard index"
        assert index["version"] == SHARD_VERSION, f"version {index['version']} (expected {SHARD_VERSION})"
        dtype = np.dtype(index["dtype"])
        assert dtype in (np.uint16, np.uint32), f"dtype {dtype} is not uint16 or uint32"
        assert index["vocab_size"] <= np.iinfo(dtype).max + 1, (
            f"vocab {index['vocab_size']} overflows {dtype}"
        )
        shards = index["splits"][split]["shards"]
        bos_id = int(index["bos_id"])
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as e:
        raise ConfigError(f"{index_path}: corrupt shard index ({e}); {fix}") from None
    if index["tokenizer_hash"] != tokenizer.hash:
        raise ConfigError(
            f"{index_path}: the shards were tokenized with data.tokenizer = {index['tokenizer']!r}, "
            f"not {tokenizer.spec!r} (a different rank file); set data.tokenizer to the shards' "
            f"tokenizer, or {fix[:-1]} --tokenizer {shlex.quote(str(tokenizer.spec))}`"
        )
    if vocab_size is not None and index["vocab_size"] > vocab_size:
        raise ConfigError(
            f"{index_path}: the shards' vocabulary ({index['vocab_size']} ids, {dtype}) does not fit "
            f"the model's vocab_size {vocab_size}; raise model.vocab_size or re-run prepare with a "
            "smaller tokenizer"
        )
    arrays, names, doc_arrays, doc_starts, doc_lens = [], [], [], [], []
    for i, shard in enumerate(shards):
        file = folder / shard["file"]
        arr, offsets = _open_shard(file, folder / shard["offsets"], int(shard["tokens"]), dtype, fix)
        if vocab_size is not None and int(shard["max_token_id"]) >= vocab_size:
            raise ConfigError(
                f"{file}: holds token id {shard['max_token_id']} >= the model's vocab_size {vocab_size}; "
                "raise model.vocab_size or re-run prepare"
            )
        arrays.append(arr)
        names.append(str(file))
        doc_arrays.append(np.full(len(offsets) - 1, i, np.int32))
        doc_starts.append(offsets[:-1])
        doc_lens.append(np.diff(offsets))
    if not arrays or sum(len(d) for d in doc_lens) == 0:
        raise ConfigError(f"{index_path}: the {split} split holds no documents; {fix} from more data")
    return TokenCorpus(
        arrays,
        np.concatenate(doc_arrays),
        np.concatenate(doc_starts),
        np.concatenate(doc_lens),
        names,
        bos_id,
    )


def _open_shard(
    file: Path, offsets_file: Path, n_tokens: int, dtype: np.dtype, fix: str
) -> tuple[np.ndarray, np.ndarray]:
    if not file.is_file() or not offsets_file.is_file():
        missing = file if not file.is_file() else offsets_file
        raise ConfigError(f"{missing}: shard file missing; {fix}")
    if file.stat().st_size != n_tokens * dtype.itemsize:
        raise ConfigError(
            f"{file}: {file.stat().st_size} bytes, but the index says {n_tokens} {dtype} tokens "
            f"({n_tokens * dtype.itemsize} bytes); the shard is truncated or of another dtype; {fix}"
        )
    try:
        offsets = np.load(offsets_file, allow_pickle=False).astype(np.int64)
    except (OSError, ValueError, EOFError) as e:  # (numpy's advice to load pickles unsafely: not repeated)
        what = "pickled data, not an array" if "pickle" in str(e) else str(e) or type(e).__name__
        raise ConfigError(f"{offsets_file}: unreadable document offsets ({what}); {fix}") from None
    if (
        offsets.ndim != 1
        or len(offsets) < 1
        or offsets[0] != 0
        or offsets[-1] != n_tokens
        or np.any(np.diff(offsets) <= 0)
    ):
        raise ConfigError(f"{offsets_file}: document offsets do not match {file.name}; {fix}")
    arr = np.memmap(file, dtype=dtype, mode="r") if n_tokens else np.empty(0, dtype)
    return arr, offsets


# ----------------------------------------------------------------------------------------------
# The stream


class TokenStream:
    """All documents back to back, epoch after epoch, readable at any position.

    Epoch e holds every document once, in the order `permutation(seed, e)` (or corpus order when
    `shuffle` is off), so position p of the stream is a pure function of (corpus, seed, p).
    """

    def __init__(
        self, corpus: TokenCorpus, *, seed: int, shuffle: bool, vocab_limit: int | None = None
    ) -> None:
        self.corpus = corpus
        self.seed = seed
        self.shuffle = shuffle
        self.vocab_limit = vocab_limit
        self.epoch_tokens = corpus.n_tokens
        assert self.epoch_tokens > 0
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, end position of each document in the epoch) for `epoch`."""
        if epoch not in self._layouts:
            n = len(self.corpus.doc_len)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            if len(self._layouts) >= 2:
                self._layouts.pop(min(self._layouts))
            self._layouts[epoch] = (order, np.cumsum(self.corpus.doc_len[order]))
        return self._layouts[epoch]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the endless stream, as int64."""
        c = self.corpus
        out = np.empty(n, np.int64)
        filled = 0
        while filled < n:
            epoch, off = divmod(start + filled, self.epoch_tokens)
            order, ends = self.layout(epoch)
            i = int(np.searchsorted(ends, off, side="right"))
            while filled < n and i < len(order):
                d = order[i]
                lo = off - (int(ends[i]) - int(c.doc_len[d]))
                take = min(int(c.doc_len[d]) - lo, n - filled)
                begin = int(c.doc_start[d]) + lo
                piece = c.arrays[c.doc_array[d]][begin : begin + take]
                if self.vocab_limit is not None and int(piece.max()) >= self.vocab_limit:
                    raise ConfigError(
                        f"{c.names[c.doc_array[d]]}: token id {int(piece.max())} >= the model's vocab_size "
                        f"{self.vocab_limit}; the shard is corrupt, re-run prepare"
                    )
                out[filled : filled + take] = piece
                filled += take
                off += take
                i += 1
        return out
