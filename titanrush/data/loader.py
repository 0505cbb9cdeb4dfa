"""Batches, the stateful per-rank loader, and `build_dataloader`.

The global window stream: window w is `stream[w*T : w*T + T + 1]` (inputs are its first T tokens,
labels its last T). Data-parallel rank r of D with local batch B takes micro-batch j = windows
[(j*D + r)*B, (j*D + r + 1)*B). So the windows of one optimizer step depend only on the global batch
size, never on the mesh, and the loader's whole state is j.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.utils.data

from titanrush.config import ConfigError, Data
from titanrush.data import sources
from titanrush.data.corpus import (
    TokenCorpus,
    TokenStream,
    cache_key,
    cached_corpus,
    frame,
    load_shards,
    token_dtype,
    tokenize_documents,
)
from titanrush.data.sources import Document
from titanrush.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SYNTHETIC_VALIDATION_WINDOWS = 4096
"""The synthetic dataset's validation split: this many windows (drawn apart from the train ones)."""
STATE_VERSION = 1


@dataclass
class Batch:
    """One micro-batch. Document boundaries ride along for block-causal attention.

    Attributes:
        input_ids: (B, T) int64 token ids.
        labels: (B, T) int64, the next token of each input.
        position_ids: (B, T) int64, restarting at 0 at each document start (and at the window start).
        document_ids: (B, T) int32, ordinal of each token's document within its window (0 first).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy on `device` (use non_blocking with pinned host batches)."""
        return Batch(*(getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)))

    def pin_memory(self) -> Batch:
        """A copy in pinned host memory (torch's DataLoader calls this when pin_memory is on)."""
        return Batch(*(getattr(self, f.name).pin_memory() for f in fields(self)))


def make_batch(windows: np.ndarray, bos_id: int) -> Batch:
    """A Batch from (B, T + 1) token windows; a BOS token marks each document start."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    b, t = inputs.shape
    starts = inputs == bos_id
    starts[:, 0] = True  # a window's first token starts its first (maybe partial) document
    arange = np.arange(t, dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts, arange, 0), axis=1)
    return Batch(
        input_ids=torch.from_numpy(np.array(inputs, dtype=np.int64)),  # copies: windows may be read-only
        labels=torch.from_numpy(np.array(labels, dtype=np.int64)),
        position_ids=torch.from_numpy(arange - last_start),
        document_ids=torch.from_numpy(np.cumsum(starts, axis=1, dtype=np.int32) - 1),
    )


@dataclass(frozen=True)
class RankLayout:
    """Which windows of the global stream one data-parallel rank reads."""

    seq_len: int
    local_batch_size: int
    dp_rank: int
    dp_degree: int

    @property
    def windows_per_round(self) -> int:
        """Windows all ranks take together per micro-batch index (B x D)."""
        return self.local_batch_size * self.dp_degree

    def first_window(self, j: int) -> int:
        """Global index of the first window of this rank's micro-batch j."""
        return (j * self.dp_degree + self.dp_rank) * self.local_batch_size


class TokenWindows(torch.utils.data.Dataset):
    """The (B, T + 1) token windows of one rank's micro-batch j, read from a random-access stream.

    Datasets return raw windows, and the loader makes the Batch: from worker processes one small
    array travels through a pipe instead of four tensors through shared memory.
    """

    def __init__(self, stream: TokenStream, layout: RankLayout) -> None:
        self.stream = stream
        self.layout = layout

    def __getitem__(self, j: int) -> np.ndarray:
        t, b = self.layout.seq_len, self.layout.local_batch_size
        tokens = self.stream.read(self.layout.first_window(j) * t, b * t + 1)
        return np.lib.stride_tricks.sliding_window_view(tokens, t + 1)[::t]  # rows overlap by one token


class SyntheticWindows(torch.utils.data.Dataset):
    """Windows of one rank's micro-batch j, of random ids; window w is drawn from (seed, split, w)."""

    def __init__(self, layout: RankLayout, *, seed: int, split: str, high: int) -> None:
        self.layout, self.seed, self.high = layout, seed, high
        self.split_tag = sources.SPLITS.index(split)

    def __getitem__(self, j: int) -> np.ndarray:
        first, t = self.layout.first_window(j), self.layout.seq_len
        rows = [
            np.random.default_rng([self.seed, self.split_tag, w]).integers(0, self.high, t + 1)
            for w in range(first, first + self.layout.local_batch_size)
        ]
        return np.stack(rows)


def stream_windows(
    documents: Callable[[], Iterable[Document]], tokenizer: Tokenizer, seq_len: int, cycle: bool
) -> Iterator[np.ndarray]:
    """Windows w = 0, 1, ... of documents read in order (sequential twin of an unshuffled TokenStream)."""
    buf = np.empty(0, np.int64)
    dtype = token_dtype(tokenizer.n_words)
    while True:
        n_docs = 0
        for doc in documents():
            n_docs += 1
            tokens, _ = frame(tokenizer.encode_arrays([doc.text]), tokenizer.bos_id, tokenizer.eos_id, dtype)
            buf = np.concatenate([buf, tokens.astype(np.int64)])
            while len(buf) >= seq_len + 1:
                yield buf[: seq_len + 1]
                buf = buf[seq_len:]
        if not cycle or n_docs == 0:
            return


def rank_batches(
    windows: Iterator[np.ndarray], layout: RankLayout, start: int, bos_id: int
) -> Iterator[Batch]:
    """This rank's micro-batches start, start+1, ... from sequential windows; a round of D x B windows
    counts only once complete, so every rank yields the same number of batches."""
    b, r = layout.local_batch_size, layout.dp_rank
    rounds = iter(lambda: list(itertools.islice(windows, layout.windows_per_round)), [])
    for j, group in enumerate(rounds):
        if len(group) < layout.windows_per_round:
            return
        if j >= start:
            yield make_batch(np.stack(group[r * b : (r + 1) * b]), bos_id)


class DataLoader:
    """The micro-batches of one data-parallel rank, with a resumable position.

    Iterating a train loader continues from the current position, forever; iterating a validation
    loader replays the same finite sequence from its start. `load_state_dict` also redirects an
    iterator that is already running.
    """

    def __init__(
        self,
        open_batches: Callable[[int], Iterator[Batch]],
        *,
        layout: RankLayout,
        num_batches: int | None,
        identity: dict[str, Any],
        epoch_tokens: int | None = None,
    ) -> None:
        self._open = open_batches
        self.layout = layout
        self.num_batches = num_batches
        """Batches in a validation pass (None: infinite, or unknown for a stream)."""
        self.epoch_tokens = epoch_tokens
        """Tokens of one pass over the split (None: synthetic, or unknown for a stream)."""
        self.finite = identity["split"] == "validation"
        self._identity = identity
        self._next = 0
        self._generation = 0

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("this loader has no length (the train split is infinite)")
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        if self.finite:
            yield from self._open(0)
            return
        while True:
            generation = self._generation
            batches = self._open(self._next)
            for batch in batches:
                if generation != self._generation:
                    break  # load_state_dict() moved the position: reopen there
                self._next += 1
                yield batch
            else:
                raise ConfigError(
                    f"data.dataset = {self._identity['dataset']!r}: the stream holds no documents"
                )
            del batches  # shuts down worker processes before new ones start

    def state_dict(self) -> dict[str, Any]:
        """Plain values: the next micro-batch index, the global window position and what they mean."""
        windows = self._next * self.layout.windows_per_round
        return {"version": STATE_VERSION, "next_batch": self._next, "windows": windows, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the saved loader stopped, even on a different data-parallel mesh.

        Raises:
            ConfigError: the state comes from another dataset, split, seed or seq_len, or its
                position is not a whole number of this mesh's rounds (B x D windows).
        """
        if state.get("path") != self._identity["path"]:
            logger.warning(
                "resuming the data stream of %r from %r (moved?)", state.get("path"), self._identity["path"]
            )
        for key in ("dataset", "split", "seed", "seq_len"):
            if state.get(key) != self._identity[key]:
                raise ConfigError(
                    f"the checkpoint's data loader has {key} = {state.get(key)!r}, this run "
                    f"{self._identity[key]!r}: resuming would not continue the same data; keep the "
                    "setting or start a new run"
                )
        j, rest = divmod(int(state["windows"]), self.layout.windows_per_round)
        if rest:
            raise ConfigError(
                f"the checkpoint stopped after {state['windows']} windows, not a multiple of this "
                f"mesh's {self.layout.windows_per_round} (local batch x dp degree); choose a batch "
                "layout that divides it"
            )
        self._next = j
        self._generation += 1


# ----------------------------------------------------------------------------------------------
# Building


def build_dataloader(
    cfg: Data,
    *,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_degree: int = 1,
    seed: int = 42,
    split: str = "train",
    vocab_size: int | None = None,
) -> DataLoader:
    """The loader of one data-parallel rank for `split` ("train": infinite; "validation": finite).

    Args:
        cfg: the `[data]` config section.
        tokenizer: from `build_tokenizer(cfg.tokenizer)`.
        seq_len: tokens per sequence (T).
        local_batch_size: sequences per micro-batch on this rank (B).
        dp_rank: this rank's data-parallel index (tp/cp/pp peers pass the same one).
        dp_degree: data-parallel ranks (D).
        seed: shuffles the train document order per epoch (and draws synthetic tokens).
        split: "train" or "validation".
        vocab_size: the model's vocabulary; every token id must be below it.

    Raises:
        ConfigError: missing, empty or unreadable data, or ids that do not fit `vocab_size`.
    """
    sources.check_split(split)
    if seq_len <= 0 or local_batch_size <= 0 or not 0 <= dp_rank < dp_degree:
        raise ValueError(
            f"bad layout: seq_len={seq_len}, local_batch_size={local_batch_size}, dp {dp_rank}/{dp_degree}"
        )
    if (
        vocab_size is not None
        and cfg.dataset not in ("shards", "synthetic")
        and tokenizer.n_words > vocab_size
    ):
        raise ConfigError(
            f"the tokenizer {tokenizer.spec!r} has {tokenizer.n_words} ids but the model's vocab_size is "
            f"{vocab_size}; set model.vocab_size >= {tokenizer.n_words} or use a smaller tokenizer"
        )
    layout = RankLayout(seq_len, local_batch_size, dp_rank, dp_degree)
    identity = {"dataset": cfg.dataset, "path": cfg.path, "split": split, "seed": seed, "seq_len": seq_len}
    identity |= {"dp_rank": dp_rank, "dp_degree": dp_degree, "local_batch_size": local_batch_size}
    finite = split == "validation"
    pin = cfg.pin_memory and torch.cuda.is_available()

    if cfg.dataset == "hf":
        if cfg.num_workers:
            logger.warning("data.dataset = 'hf' streams in the training process; ignoring data.num_workers")
        sources.hf_documents(cfg.path, cfg.text_field, split)  # fail now on a missing package or dataset

        def open_stream(start: int) -> Iterator[Batch]:
            docs = lambda: sources.hf_documents(cfg.path, cfg.text_field, split)
            windows = stream_windows(docs, tokenizer, seq_len, cycle=not finite)
            batches = rank_batches(windows, layout, start, tokenizer.bos_id)
            return (b.pin_memory() if pin else b for b in batches)

        return DataLoader(open_stream, layout=layout, num_batches=None, identity=identity)

    epoch_tokens = None
    if cfg.dataset == "synthetic":
        high = min(tokenizer.n_ranks, vocab_size or tokenizer.n_ranks)  # ordinary ids only: no BOS inside
        dataset = SyntheticWindows(layout, seed=seed, split=split, high=high)
        n_windows = SYNTHETIC_VALIDATION_WINDOWS
    else:
        corpus = _corpus(cfg, tokenizer, split, vocab_size)
        limit = vocab_size if cfg.dataset == "shards" else None
        stream = TokenStream(corpus, seed=seed, shuffle=cfg.shuffle and not finite, vocab_limit=limit)
        dataset = TokenWindows(stream, layout)
        n_windows = (corpus.n_tokens - 1) // seq_len
        epoch_tokens = corpus.n_tokens
        logger.info(
            "data %s/%s: %d documents, %d tokens", cfg.dataset, split, len(corpus.doc_len), corpus.n_tokens
        )

    num_batches = n_windows // layout.windows_per_round if finite else None
    if num_batches == 0:
        raise ConfigError(
            f"the validation split of data.dataset = {cfg.dataset!r} holds {n_windows} windows of "
            f"{seq_len} tokens, fewer than one round of {layout.windows_per_round} (local batch x dp "
            "degree); lower the batch or seq_len, add data, or set validation.freq = 0"
        )

    def to_batch(windows: np.ndarray) -> Batch:
        batch = make_batch(windows, tokenizer.bos_id)
        return batch.pin_memory() if pin else batch

    def open_batches(start: int) -> Iterator[Batch]:
        indices = range(start, num_batches) if num_batches is not None else itertools.count(start)
        if cfg.num_workers == 0:
            return (to_batch(dataset[j]) for j in indices)
        workers = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            sampler=indices,
            num_workers=cfg.num_workers,
            collate_fn=_as_is,
            prefetch_factor=cfg.prefetch_factor,
        )
        return (to_batch(windows) for windows in _unwrapped(workers))

    return DataLoader(
        open_batches, layout=layout, num_batches=num_batches, identity=identity, epoch_tokens=epoch_tokens
    )


def repeats(loader: DataLoader, cfg: Data, steps: int, accum: int, step: int = 0) -> str | None:
    """A line saying that a train run reading from `loader`'s position, at step `step`, on to step `steps`
    (`accum` micro-batches a step) reads the data of `cfg` more than once; None where it does not, or where
    the data's size is unknown (synthetic, hf)."""
    n = loader.epoch_tokens
    if n is None or steps <= step:
        return None
    t = loader.layout.seq_len
    per_step = loader.layout.windows_per_round * accum * t
    read = loader.state_dict()["windows"] * t  # (a resumed run's position, whatever its batch layout was)
    total = read + (steps - step) * per_step
    if total <= n:
        return None
    first = step + 1 + max(0, (n - read) // per_step)  # the first step that reads a token read before
    more = (
        "train on more data (data.dataset = 'files' or 'shards', with data.path)"
        if cfg.dataset == "embedded"
        else "add data (data.path)"
    )
    order = "in a new order each pass" if cfg.shuffle else "in the same order"
    return (
        f"data.dataset = {cfg.dataset!r}: by step {steps} the run reads {total:,} tokens, "
        f"{total / n:.2f} passes over the {n:,} tokens of its train split; from step {first} on it reads "
        f"tokens it has read before ({order}). If that is not meant, {more} or lower training.steps"
    )


def _unwrapped(workers: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """The workers' windows; a ConfigError raised in a worker (a corrupt shard) as the worker raised it:
    torch raises it again with the worker's traceback pasted into its message."""
    try:
        yield from workers
    except ConfigError as e:
        text = str(e).rstrip().splitlines()
        if not text or not text[0].startswith("Caught ConfigError"):
            raise
        raise ConfigError(text[-1].split("ConfigError: ", 1)[-1]) from None


def _as_is(windows: np.ndarray) -> np.ndarray:
    """Keep worker results as numpy (torch would turn them into shared-memory tensors)."""
    return windows


def _corpus(cfg: Data, tokenizer: Tokenizer, split: str, vocab_size: int | None) -> TokenCorpus:
    """The tokenized documents of `split` for the embedded, files and shards datasets."""
    if cfg.dataset == "shards":
        return load_shards(cfg.path, split, tokenizer, vocab_size)
    if cfg.dataset == "embedded":
        files = sources.embedded_files(split)
        key = cache_key(tokenizer, f"embedded|{split}", files)
        label = f"embedded corpus ({split})"
        docs = lambda: sources.embedded_documents(split, files)
    elif cfg.dataset == "files":
        root, files = sources.find_files(cfg.path)
        key = cache_key(tokenizer, f"files|{root.resolve()}|{cfg.text_field}|{split}", files)
        label = f"data.path = {cfg.path!r} ({split})"
        docs = lambda: sources.file_documents(cfg.path, cfg.text_field, split)
    else:
        raise ConfigError(
            f"data.dataset = {cfg.dataset!r} is not one of embedded, files, synthetic, shards, hf"
        )

    def build() -> TokenCorpus:
        corpus = tokenize_documents(docs(), tokenizer)
        if corpus.n_tokens == 0:  # raised before anything is cached
            raise ConfigError(
                f"{label}: no text in the {split} split (about 1% of documents are held out for validation); "
                "add documents or point data.path at a larger corpus"
                + (", or set validation.freq = 0" if split == "validation" else "")
            )
        return corpus

    return cached_corpus(key, cfg.cache_dir, build, tokenizer, label)
