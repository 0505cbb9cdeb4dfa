"""The data layer: batches, document boundaries, mesh invariance, resumption, datasets, bad input."""

from __future__ import annotations

import base64
import importlib.util
import itertools
import json
import logging
import os
import pickle
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from titanrush.config import ConfigError, Data
from titanrush.data import Batch, DataLoader, Tokenizer, build_dataloader, build_tokenizer, repeats, sources
from titanrush.data.corpus import TokenStream, load_shards, tokenize_documents
from titanrush.data.loader import RankLayout, TokenWindows, make_batch, rank_batches, stream_windows
from titanrush.data.prepare import main as prepare_main

T, B = 32, 4
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "the",
    "a",
    "of",
    "data",
    "token",
    "x1",
    "(",
    ")",
    "=",
    "\n",
    "    ",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer("default")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def make_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 .jsonl documents in two files and 6 .txt documents, of 3 to 300 words."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(1234)
    (root / "sub").mkdir()
    for name in ("a.jsonl", "sub/b.jsonl"):
        lines = [json.dumps({"text": make_text(rng, rng.randint(3, 300)), "id": i}) for i in range(200)]
        (root / name).write_text("\n".join(lines) + "\n")
    for i in range(6):
        (root / f"doc{i}.txt").write_text(make_text(rng, rng.randint(3, 300)))
    (root / "ignored.csv").write_text("not,read\n")
    return root


def cfg(tmp_path: Path, **kw: object) -> Data:
    return Data(**{"cache_dir": str(tmp_path / "cache"), **kw})  # type: ignore[arg-type]


def loader(
    data: Data, tok: Tokenizer, *, seq_len: int = T, b: int = B, rank: int = 0, degree: int = 1, **kw: object
) -> DataLoader:
    return build_dataloader(
        data, tokenizer=tok, seq_len=seq_len, local_batch_size=b, dp_rank=rank, dp_degree=degree, **kw
    )  # type: ignore[arg-type]


def take(dl: DataLoader, n: int) -> list[Batch]:
    return list(itertools.islice(iter(dl), n))


def assert_same(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("input_ids", "labels", "position_ids", "document_ids"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name


def framed(tok: Tokenizer, texts: list[str]) -> list[int]:
    return [i for t in texts for i in tok.encode(t, bos=True, eos=True)]


def split_texts(root: Path, split: str) -> list[str]:
    """Documents of `split` under root, read independently of the loader (sorted files, file order)."""
    texts = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl")):
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".txt":
            if sources.split_of(rel) == split:
                texts.append(path.read_text())
            continue
        offset = 0
        for line in path.read_bytes().splitlines(keepends=True):
            if sources.split_of(f"{rel}:{offset}") == split:
                texts.append(json.loads(line)["text"])
            offset += len(line)
    return texts


# ----------------------------------------------------------------------------------------------
# Batches and documents


def test_batch_fields_and_shifted_labels(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    batches = take(loader(cfg(tmp_path, dataset="files", path=str(corpus_dir)), tok), 6)
    for batch in batches:
        assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (B, T)
        assert batch.document_ids.shape == (B, T)
        assert batch.input_ids.dtype == batch.labels.dtype == batch.position_ids.dtype == torch.int64
        assert batch.document_ids.dtype == torch.int32
        assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])
        assert torch.equal(batch.labels[:-1, -1], batch.input_ids[1:, 0])  # windows are contiguous
    for prev, nxt in zip(batches, batches[1:]):
        assert prev.labels[-1, -1] == nxt.input_ids[0, 0]
    moved = batches[0].to("cpu", non_blocking=True)
    assert isinstance(moved, Batch) and torch.equal(moved.input_ids, batches[0].input_ids)


def test_document_boundaries(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    batches = take(loader(cfg(tmp_path, dataset="files", path=str(corpus_dir)), tok), 60)
    starts_seen = 0
    for batch in batches:
        for row in range(B):
            ids = batch.input_ids[row].tolist()
            pos, doc = [], []
            for t, token in enumerate(ids):
                new_doc = t > 0 and token == tok.bos_id
                pos.append(0 if t == 0 or new_doc else pos[-1] + 1)
                doc.append(0 if t == 0 else doc[-1] + new_doc)
                starts_seen += new_doc
            assert batch.position_ids[row].tolist() == pos
            assert batch.document_ids[row].tolist() == doc
        eos = batch.input_ids == tok.eos_id
        assert torch.all(batch.labels[eos] == tok.bos_id)  # documents are joined as ... EOS BOS ...
    assert starts_seen > 10  # the corpus has short documents, so windows hold several


def test_stream_is_the_documents_in_order(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    expected = framed(tok, split_texts(corpus_dir, "train"))
    data = cfg(tmp_path, dataset="files", path=str(corpus_dir), shuffle=False)
    n = len(expected) // (B * T) + 3  # past the end of the first epoch
    got = torch.cat([b.input_ids.reshape(-1) for b in take(loader(data, tok), n)]).tolist()
    assert got == (expected + expected)[: len(got)]


def test_a_run_that_reads_its_data_again_is_told_from_which_step(
    tmp_path: Path, tok: Tokenizer, corpus_dir: Path
) -> None:
    """A 5-token corpus used to train the same tokens over and over without a word."""
    n = len(framed(tok, split_texts(corpus_dir, "train")))
    data = cfg(tmp_path, dataset="files", path=str(corpus_dir), shuffle=False)
    dl = loader(data, tok, degree=2)  # a round: B x 2 windows of T tokens
    per_step = 2 * B * T
    fit = n // per_step  # the steps that read no token twice
    assert repeats(dl, data, fit, accum=1) is None
    line = repeats(dl, data, fit + 1, accum=1)
    assert line is not None
    assert f"from step {fit + 1} on" in line and f"{n:,} tokens of its train split" in line
    assert f"{(fit + 1) * per_step / n:.2f} passes" in line and "in the same order" in line
    assert "add data (data.path)" in line
    again = repeats(dl, data, fit // 2 + 1, accum=2)  # gradient accumulation reads twice the windows
    assert again is not None and f"from step {fit // 2 + 1} on" in again
    # resumed at step 3 of a run with twice this batch (6 rounds of this layout read): counted from there
    dl.load_state_dict({**dl.state_dict(), "windows": 6 * dl.layout.windows_per_round})
    assert repeats(dl, data, 3 + (n - 6 * per_step) // per_step, accum=1, step=3) is None
    resumed = repeats(dl, data, fit, accum=1, step=3)
    assert resumed is not None and f"from step {3 + 1 + (n - 6 * per_step) // per_step} on" in resumed
    shuffled = cfg(tmp_path, dataset="files", path=str(corpus_dir))
    assert "in a new order each pass" in repeats(loader(shuffled, tok), shuffled, 10 * fit, accum=2)
    synthetic = cfg(tmp_path, dataset="synthetic")  # no size to speak of
    assert repeats(loader(synthetic, tok), synthetic, 10**9, accum=1) is None


def test_shuffled_epochs_are_permutations(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    texts = split_texts(corpus_dir, "train")
    corpus = tokenize_documents([sources.Document(str(i), t) for i, t in enumerate(texts)], tok)
    n = corpus.n_tokens

    def epoch_docs(seed: int, epoch: int) -> list[tuple[int, ...]]:
        tokens = TokenStream(corpus, seed=seed, shuffle=True).read(epoch * n, n).tolist()
        docs, cur = [], []
        for token in tokens:
            if token == tok.bos_id and cur:
                docs.append(tuple(cur))
                cur = []
            cur.append(token)
        return docs + [tuple(cur)]

    plain = [tuple(tok.encode(t, bos=True, eos=True)) for t in texts]
    e0, e1 = epoch_docs(7, 0), epoch_docs(7, 1)
    assert sorted(e0) == sorted(e1) == sorted(plain)
    assert e0 != e1 and e0 != plain
    assert epoch_docs(7, 0) == e0 and epoch_docs(8, 0) != e0


# ----------------------------------------------------------------------------------------------
# Mesh invariance and resumption


def global_steps(
    data: Data, tok: Tokenizer, degree: int, b: int, accum: int, steps: int
) -> list[torch.Tensor]:
    """Per optimizer step, the sequences of all ranks' micro-batches, in (micro-batch, rank) order."""
    its = [iter(loader(data, tok, b=b, rank=r, degree=degree)) for r in range(degree)]
    out = []
    for _ in range(steps):
        micro = [[next(it).input_ids for it in its] for _ in range(accum)]
        out.append(torch.cat([x for round_ in micro for x in round_]))
    return out


@pytest.mark.parametrize("dataset", ["files", "synthetic"])
def test_global_batch_is_mesh_invariant(
    tmp_path: Path, tok: Tokenizer, corpus_dir: Path, dataset: str
) -> None:
    data = cfg(tmp_path, dataset=dataset, path=str(corpus_dir))
    reference = global_steps(data, tok, degree=1, b=8, accum=1, steps=5)
    for degree, b, accum in [(2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1)]:
        got = global_steps(data, tok, degree, b, accum, steps=5)
        for ref, step in zip(reference, got):
            assert torch.equal(ref, step), (degree, b, accum)  # same windows: none twice, none dropped


def test_loader_workers_yield_the_same_batches(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    plain = cfg(tmp_path, dataset="files", path=str(corpus_dir))
    workers = cfg(tmp_path, dataset="files", path=str(corpus_dir), num_workers=2, prefetch_factor=3)
    for rank in range(2):
        assert_same(
            take(loader(plain, tok, rank=rank, degree=2), 7),
            take(loader(workers, tok, rank=rank, degree=2), 7),
        )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_exactly(tmp_path: Path, tok: Tokenizer, corpus_dir: Path, num_workers: int) -> None:
    data = cfg(tmp_path, dataset="files", path=str(corpus_dir), num_workers=num_workers)
    first = loader(data, tok, rank=1, degree=2)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    expected = [next(it) for _ in range(4)]
    state = pickle.loads(pickle.dumps(json.loads(json.dumps(state))))  # plain values
    resumed = loader(data, tok, rank=1, degree=2)
    resumed.load_state_dict(state)
    assert_same(take(resumed, 4), expected)


def test_resume_on_another_mesh(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    data = cfg(tmp_path, dataset="files", path=str(corpus_dir))
    ranks = [loader(data, tok, b=2, rank=r, degree=2) for r in range(2)]
    its = [iter(dl) for dl in ranks]
    for _ in range(3):
        for it in its:
            next(it)
    state = ranks[0].state_dict()
    expected = torch.cat([next(it).input_ids for it in its])
    single = loader(data, tok, b=4)
    single.load_state_dict(state)
    assert torch.equal(next(iter(single)).input_ids, expected)
    with pytest.raises(ConfigError, match="multiple"):
        loader(data, tok, b=8).load_state_dict(state)  # 12 windows: not whole rounds of 8
    with pytest.raises(ConfigError, match="seq_len"):
        loader(data, tok, seq_len=T * 2, b=4).load_state_dict(state)


def test_load_state_redirects_a_running_iterator(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    dl = loader(cfg(tmp_path, dataset="files", path=str(corpus_dir)), tok)
    it = iter(dl)
    first = next(it)
    state = dl.state_dict()
    second = next(it)
    next(it)
    dl.load_state_dict(state)
    assert_same([next(it)], [second])
    dl.load_state_dict({**state, "windows": 0, "next_batch": 0})
    assert_same([next(it)], [first])


# ----------------------------------------------------------------------------------------------
# Validation split


def test_validation_is_finite_fixed_and_held_out(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    data = cfg(tmp_path, dataset="files", path=str(corpus_dir), num_workers=1)
    val = [loader(data, tok, b=1, rank=r, degree=2, split="validation") for r in range(2)]
    passes = [list(val[0]), list(val[0])]
    assert len(passes[0]) == len(val[0]) == len(list(val[1])) > 0
    assert_same(passes[0], passes[1])
    held_out = framed(tok, split_texts(corpus_dir, "validation"))
    rank0_rows = torch.cat([b.input_ids.reshape(-1) for b in passes[0]]).tolist()
    assert rank0_rows[:T] == held_out[:T]  # rank 0 starts at window 0 of the held-out documents
    train_texts = set(split_texts(corpus_dir, "train"))
    assert not train_texts & set(split_texts(corpus_dir, "validation"))
    with pytest.raises(ConfigError, match="validation.freq"):
        loader(data, tok, seq_len=4096, split="validation")


def test_split_hash_holds_out_about_one_percent() -> None:
    keys = [f"dir{i % 7}/file{i}.py" for i in range(20000)]
    share = sum(sources.split_of(k) == "validation" for k in keys) / len(keys)
    assert 0.005 < share < 0.02


# ----------------------------------------------------------------------------------------------
# The embedded corpus (the real one) and the cache


def test_embedded_corpus(tmp_path: Path, tok: Tokenizer) -> None:
    data = cfg(tmp_path)
    assert data.dataset == "embedded"
    start = time.perf_counter()
    batch = next(iter(loader(data, tok, seq_len=256, b=8, vocab_size=8192)))
    assert time.perf_counter() - start < 20
    text = tok.decode(batch.input_ids.reshape(-1).tolist())
    assert "def " in text or "import " in text or "class " in text
    train, val = sources.embedded_files("train"), sources.embedded_files("validation")
    assert val and not set(train) & set(val)
    assert not any("site-packages" in p.parts or "dist-packages" in p.parts for p in train + val)
    assert 0.003 < len(val) / (len(train) + len(val)) < 0.03
    assert len(loader(data, tok, seq_len=256, b=8, split="validation")) > 0
    cached = list((tmp_path / "cache").glob("*.npz"))
    assert len(cached) == 2  # train and validation
    start = time.perf_counter()
    again = next(iter(loader(data, tok, seq_len=256, b=8, vocab_size=8192)))
    assert time.perf_counter() - start < 2
    assert_same([again], [batch])


def test_cache_stale_corrupt_and_unwritable(tmp_path: Path, tok: Tokenizer) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.txt").write_text("first version of the text " * 20)
    data = cfg(tmp_path, dataset="files", path=str(root), shuffle=False)
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("titanrush")
    level = log.level
    log.addHandler(handler)  # (on the logger itself: init_logging may have stopped its propagation)
    log.setLevel(logging.INFO)
    try:
        before = take(loader(data, tok), 1)[0].input_ids
        first = " | ".join(said)
        said.clear()
        take(loader(data, tok), 1)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    # A cold start says what takes the time and where the cache goes; the next start reads the cache.
    assert "tokenizing the documents (once" in first and str(tmp_path / "cache") in first, first
    again = " | ".join(said)
    assert "tokens from cache" in again and "tokenizing" not in again, again
    (root / "a.txt").write_text("second, longer version of the text " * 20)
    after = take(loader(data, tok), 1)[0].input_ids
    assert after[0, : len(tok.encode("second", bos=True, eos=False))].tolist() == tok.encode(
        "second", bos=True, eos=False
    )
    assert not torch.equal(before, after)
    for f in (tmp_path / "cache").glob("*.npz"):
        f.write_bytes(b"garbage")
    assert torch.equal(take(loader(data, tok), 1)[0].input_ids, after)
    (tmp_path / "file").write_text("")
    blocked = cfg(
        tmp_path, dataset="files", path=str(root), shuffle=False, cache_dir=str(tmp_path / "file" / "sub")
    )
    assert torch.equal(take(loader(blocked, tok), 1)[0].input_ids, after)
    nocache = Data(dataset="files", path=str(root), shuffle=False, cache_dir="")
    assert torch.equal(take(loader(nocache, tok), 1)[0].input_ids, after)


# ----------------------------------------------------------------------------------------------
# files dataset and bad input


def test_files_path_forms_and_text_field(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    by_dir = take(loader(cfg(tmp_path, dataset="files", path=str(corpus_dir)), tok), 3)
    by_glob = take(loader(cfg(tmp_path, dataset="files", path=f"{corpus_dir}/**/*"), tok), 3)
    assert_same(by_dir, by_glob)
    root = tmp_path / "field"
    root.mkdir()
    texts = [make_text(random.Random(i), 40) for i in range(30)]
    (root / "x.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    data = cfg(tmp_path, dataset="files", path=str(root / "x.jsonl"), text_field="body", shuffle=False)
    expected = framed(tok, split_texts_field(root, texts))
    assert take(loader(data, tok), 1)[0].input_ids.reshape(-1).tolist() == expected[: B * T]


def split_texts_field(root: Path, texts: list[str]) -> list[str]:
    offsets = np.cumsum([0] + [len((json.dumps({"body": t}) + "\n").encode()) for t in texts])
    return [t for t, o in zip(texts, offsets) if sources.split_of(f"x.jsonl:{o}") == "train"]


def bad_corpus(root: Path, kind: str) -> tuple[str, str]:
    """(data.path, the file the error must name) for one kind of bad input."""
    root.mkdir()
    (root / "good.txt").write_text("fine text " * 50)
    if kind == "missing":
        return str(root / "nope"), str(root / "nope")
    if kind == "empty":
        empty = root / "empty"
        empty.mkdir()
        (empty / "e.txt").write_text("")
        return str(empty), str(empty)
    bad = {
        "latin1": ("bad.txt", "caf\xe9 au lait".encode("latin-1")),
        "binary": ("bin.txt", b"\x00\x01\x02 not text"),
        "json": ("bad.jsonl", b'{"text": "ok"}\n{not json\n'),
        "field": ("nofield.jsonl", b'{"content": "no text field"}\n'),
        "parquet": ("t.parquet", b"PAR1 not really"),
    }[kind]
    (root / bad[0]).write_bytes(bad[1])
    return str(root), str(root / bad[0])


@pytest.mark.parametrize("kind", ["missing", "empty", "latin1", "binary", "json", "field", "parquet"])
def test_bad_files_input(tmp_path: Path, tok: Tokenizer, kind: str) -> None:
    path, culprit = bad_corpus(tmp_path / "data", kind)
    data = cfg(tmp_path, dataset="files", path=path)
    with pytest.raises(ConfigError) as e:
        take(loader(data, tok), 1)
    assert culprit in str(e.value)
    if kind == "parquet" and not _has("pyarrow"):
        assert "pip install pyarrow" in str(e.value)
    assert not list((tmp_path / "cache").glob("*.npz"))  # nothing written
    assert prepare_main(["--input", path, "--output", str(tmp_path / "out"), "--workers", "2"]) == 2
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_vocab_too_small_for_tokenizer(tmp_path: Path, tok: Tokenizer, corpus_dir: Path) -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        loader(cfg(tmp_path, dataset="files", path=str(corpus_dir)), tok, vocab_size=tok.n_words - 1)


# ----------------------------------------------------------------------------------------------
# synthetic and hf


def test_synthetic(tmp_path: Path, tok: Tokenizer) -> None:
    data = cfg(tmp_path, dataset="synthetic")
    batches = take(loader(data, tok, vocab_size=1000), 4)
    ids = torch.stack([b.input_ids for b in batches])
    assert ids.max() < 1000 and len(torch.unique(ids)) > 300  # 512 draws from 1000 ids
    assert all(torch.equal(b.position_ids, torch.arange(T).expand(B, T)) for b in batches)
    assert all(not b.document_ids.any() for b in batches)
    assert_same(batches, take(loader(data, tok, vocab_size=1000), 4))
    assert not torch.equal(
        batches[0].input_ids, take(loader(data, tok, vocab_size=1000, seed=1), 1)[0].input_ids
    )
    val = loader(data, tok, split="validation")
    assert 0 < len(val) < 10**6
    assert not torch.equal(next(iter(val)).input_ids, batches[0].input_ids)


@pytest.mark.skipif(_has("datasets"), reason="the datasets package is installed here")
def test_hf_without_datasets_package(tmp_path: Path, tok: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="pip install datasets"):
        loader(cfg(tmp_path, dataset="hf", path="allenai/c4"), tok)


def test_streaming_windows_match_random_access(tok: Tokenizer, corpus_dir: Path) -> None:
    docs = [sources.Document(str(i), t) for i, t in enumerate(split_texts(corpus_dir, "train"))]
    corpus = tokenize_documents(docs, tok)
    for rank in range(2):
        layout = RankLayout(T, 2, rank, 2)
        windows = TokenWindows(TokenStream(corpus, seed=0, shuffle=False), layout)
        expected = [
            make_batch(windows[j], tok.bos_id) for j in range(3, 12)
        ]  # 9 micro-batches, crossing the epoch end
        streamed = rank_batches(stream_windows(lambda: iter(docs), tok, T, cycle=True), layout, 3, tok.bos_id)
        assert_same(list(itertools.islice(streamed, 9)), expected)


# ----------------------------------------------------------------------------------------------
# shards and prepare


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("shards") / "out"
    assert prepare_main(["--input", str(corpus_dir), "--output", str(out), "--workers", "1"]) == 0
    return out


def test_prepare_output(
    tmp_path: Path, shards: Path, corpus_dir: Path, tok: Tokenizer, capsys: pytest.CaptureFixture
) -> None:
    index = json.loads((shards / "index.json").read_text())
    assert (
        index["dtype"] == "uint16" and index["vocab_size"] == tok.n_words and index["tokenizer"] == "default"
    )
    train = index["splits"]["train"]
    assert train["tokens"] == len(framed(tok, split_texts(corpus_dir, "train")))
    offsets = np.load(shards / train["shards"][0]["offsets"])
    assert len(offsets) == train["documents"] + 1
    tokens = np.fromfile(shards / train["shards"][0]["file"], dtype=np.uint16)
    assert (tokens[offsets[:-1]] == tok.bos_id).all() and (tokens[offsets[1:] - 1] == tok.eos_id).all()
    # More workers, smaller jsonl chunks and shards: the same tokens.
    out = tmp_path / "par"
    args = ["--input", str(corpus_dir), "--output", str(out), "--workers", "2", "--shard-tokens", "5000"]
    capsys.readouterr()
    assert prepare_main(args) == 0
    assert "tokens/s" in capsys.readouterr().out
    index2 = json.loads((out / "index.json").read_text())
    assert len(index2["splits"]["train"]["shards"]) > 1
    joined = np.concatenate(
        [np.fromfile(out / s["file"], np.uint16) for s in index2["splits"]["train"]["shards"]]
    )
    assert np.array_equal(joined, tokens)
    assert prepare_main(args) == 2  # the output exists
    assert prepare_main(args + ["--overwrite"]) == 0


def prepare_errors(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """`titanrush prepare` on bad input: exit 2, one line with one `error:` prefix, no traceback."""
    assert prepare_main(["--workers", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("titanrush prepare: error: ") and err.count("error:") == 1, err
    return err


def test_prepare_refuses_an_output_it_cannot_write(
    tmp_path: Path, corpus_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """A file where the folder or its parent should be: one line before any tokenizing, nothing written
    (root may write anywhere, so the unwritable parent here is a file)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me\n")
    for output, overwrite in [
        (a_file / "shards", []),
        (a_file / "deeper" / "shards", []),
        (a_file, []),
        (a_file, ["--overwrite"]),
    ]:
        err = prepare_errors(["--input", str(corpus_dir), "--output", str(output), *overwrite], capsys)
        assert f"{a_file} is a file" in err and "choose" in err, err
        assert "pass --overwrite" not in err  # (it would be refused too)
    assert a_file.read_text() == "keep me\n" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_prepare_names_its_own_flags_in_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The checks it shares with training name --tokenizer / --text-field, not data.tokenizer / ..."""
    (tmp_path / "a.jsonl").write_text('{"body": "hello world"}\n')
    out = ["--output", str(tmp_path / "out")]
    cases = [
        (["--input", str(tmp_path / "a.jsonl")], "no string field 'text'; set --text-field to the field"),
        (
            ["--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(tmp_path / "none")],
            "pass --tokenizer 'def",
        ),
        (["--input", str(tmp_path / "a.jsonl"), "--tokenizer", ""], "--tokenizer is empty; pass 'default'"),
    ]
    for argv, named in cases:
        err = prepare_errors([*argv, *out], capsys)
        assert named in err and "data." not in err, err
    assert not (tmp_path / "out").exists()


def test_prepare_suggests_overwrite_only_where_it_works(
    tmp_path: Path, corpus_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine\n")
    args = ["--input", str(corpus_dir / "doc0.txt"), "--output"]
    for flags in ([], ["--overwrite"]):
        err = prepare_errors([*args, str(other), *flags], capsys)
        assert "not shards that --overwrite may replace" in err and "choose a new or empty folder" in err
    assert [p.name for p in other.iterdir()] == ["keep.txt"]
    shards = tmp_path / "shards"
    assert prepare_main(["--workers", "1", *args, str(shards)]) == 0
    capsys.readouterr()
    err = prepare_errors([*args, str(shards)], capsys)
    assert "already holds shards; choose a new folder or pass --overwrite" in err
    assert prepare_main(["--workers", "1", *args, str(shards), "--overwrite"]) == 0


def test_a_failed_shard_write_leaves_nothing_and_keeps_the_old_shards(
    tmp_path: Path, corpus_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titanrush.data import prepare

    args = ["--input", str(corpus_dir / "doc0.txt"), "--output"]
    shards = tmp_path / "shards"
    assert prepare_main(["--workers", "1", *args, str(shards)]) == 0
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    capsys.readouterr()

    def full_disk(self: object, tokens: np.ndarray, lens: np.ndarray) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare._ShardWriter, "_write", full_disk)
    for output, flags in [(tmp_path / "new" / "deeper", []), (shards, ["--overwrite"])]:
        err = prepare_errors([*args, str(output), *flags], capsys)
        assert f"cannot write --output {output} (No space left on device); nothing was written" in err
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before  # the old shards, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["shards"]  # no new folder, no temporary


def test_shards_match_files_dataset(tmp_path: Path, shards: Path, corpus_dir: Path, tok: Tokenizer) -> None:
    for split, n in [("train", 12), ("validation", 2)]:
        from_files = take(
            loader(cfg(tmp_path, dataset="files", path=str(corpus_dir)), tok, b=1, split=split), n
        )
        from_shards = take(
            loader(cfg(tmp_path, dataset="shards", path=str(shards)), tok, b=1, split=split), n
        )
        assert_same(from_files, from_shards)


def test_bad_shards(tmp_path: Path, shards: Path, tok: Tokenizer) -> None:
    def load(path: Path, vocab_size: int | None = 8192, t: Tokenizer = tok) -> None:
        take(loader(cfg(tmp_path, dataset="shards", path=str(path)), t, vocab_size=vocab_size), 200)

    with pytest.raises(ConfigError, match="titanrush prepare"):
        load(tmp_path / "none")
    with pytest.raises(ConfigError, match="vocab_size") as e:
        load(shards, vocab_size=1000)
    assert "index.json" in str(e.value)
    for damage in ("truncate", "big_id", "index"):
        bad = tmp_path / damage
        bad.mkdir()
        for f in shards.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        shard = bad / "train_00000.bin"
        culprit = shard
        if damage == "truncate":
            shard.write_bytes(shard.read_bytes()[:-3])
        elif damage == "big_id":
            tokens = np.fromfile(shard, np.uint16)
            tokens[100] = 9000
            tokens.tofile(shard)
        else:
            culprit = bad / "index.json"
            culprit.write_text("{not json")
        with pytest.raises(ConfigError) as e:
            load(bad)
        assert str(culprit) in str(e.value)


@pytest.mark.parametrize("damage", ["empty", "truncated", "random"])
def test_a_damaged_offsets_file_is_named_without_numpys_advice_to_unpickle(
    tmp_path: Path, shards: Path, tok: Tokenizer, damage: str
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in shards.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    offsets = bad / "train_00000.docs.npy"
    good = offsets.read_bytes()
    offsets.write_bytes({"empty": b"", "truncated": good[:60], "random": os.urandom(len(good))}[damage])
    with pytest.raises(ConfigError) as e:
        take(loader(cfg(tmp_path, dataset="shards", path=str(bad)), tok, vocab_size=8192), 200)
    said = str(e.value)
    assert f"{offsets}: unreadable document offsets" in said and "titanrush prepare" in said, said
    assert "allow_pickle" not in said and "unsafely" not in said, said


def write_big_tokenizer(path: Path) -> Path:
    """A rank file of Llama 3's size (128000 ranks): ids do not fit uint16."""
    tokens = [bytes([i]) for i in range(256)] + [
        i.to_bytes(3, "big") for i in range(1 << 16, (1 << 16) + 127744)
    ]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def test_uint32_shards_and_tokenizer_mismatch(tmp_path: Path, corpus_dir: Path, tok: Tokenizer) -> None:
    big = write_big_tokenizer(tmp_path / "tokenizer.model")
    out = tmp_path / "big"
    assert (
        prepare_main(["--input", str(corpus_dir / "doc0.txt"), "--output", str(out), "--tokenizer", str(big)])
        == 0
    )
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint32" and index["vocab_size"] == 128256
    big_tok = build_tokenizer(str(big))
    with pytest.raises(ConfigError, match="vocab_size"):
        take(loader(cfg(tmp_path, dataset="shards", path=str(out)), big_tok, vocab_size=8192), 1)
    with pytest.raises(ConfigError, match="tokenized with") as e:
        take(loader(cfg(tmp_path, dataset="shards", path=str(out)), tok, vocab_size=128256), 1)
    # (the fix writes shards with the run's tokenizer: without --tokenizer prepare took its default)
    assert f"titanrush prepare --input GLOB --output {out} --tokenizer {tok.spec}`" in str(e.value)
    batch = take(loader(cfg(tmp_path, dataset="shards", path=str(out)), big_tok, vocab_size=128256), 1)[0]
    assert batch.input_ids[0, 0] == big_tok.bos_id


def test_shard_corpus_pickles_by_path(shards: Path, tok: Tokenizer) -> None:
    corpus = load_shards(str(shards), "train", tok, 8192)
    blob = pickle.dumps(corpus)
    assert len(blob) < corpus.n_tokens  # the shards travel as paths (spawned workers), not as data
    again = pickle.loads(blob)
    stream, copy = TokenStream(corpus, seed=3, shuffle=True), TokenStream(again, seed=3, shuffle=True)
    assert np.array_equal(stream.read(123, 5000), copy.read(123, 5000))


# ----------------------------------------------------------------------------------------------
# The data fingerprint (titanrush.data.fingerprint)


def test_fingerprint_samples_a_few_blocks_and_full_reads_every_byte(tmp_path: Path) -> None:
    """Sampled: the first, the last and 8 evenly spaced 64 KiB blocks (a small file whole); a change
    between the blocks is found only by `full`, which is what it is for."""
    from titanrush.data import fingerprint as fp

    assert fp.sample_ranges(1000) == [(0, 1000)]
    size = 4 * 2**20
    ranges = fp.sample_ranges(size)
    assert len(ranges) == fp.SAMPLES + 2 and ranges[0] == (0, fp.BLOCK)
    assert ranges[-1] == (size - fp.BLOCK, fp.BLOCK)
    assert sum(n for _, n in ranges) == 10 * fp.BLOCK  # 640 KiB read, whatever the size

    (tmp_path / "a.txt").write_bytes(np.random.default_rng(0).bytes(size))
    cfg = Data(dataset="files", path=str(tmp_path))

    def flip(offset: int) -> None:
        raw = bytearray((tmp_path / "a.txt").read_bytes())
        raw[offset] ^= 0xFF
        (tmp_path / "a.txt").write_bytes(bytes(raw))

    before = fp.fingerprint(cfg)
    assert before is not None and set(before["files"]["a.txt"]) == {"size", "mtime_ns", "sampled"}
    flip(ranges[3][0] + 5)  # inside a sampled block
    changed, _ = fp.changes(before, fp.fingerprint(cfg))
    assert changed == ["a.txt has other bytes at the same size (sampled blocks differ)"]
    flip(ranges[3][0] + 5)  # back
    assert fp.changes(before, fp.fingerprint(cfg))[0] == []
    full = Data(dataset="files", path=str(tmp_path), fingerprint="full")
    before = fp.fingerprint(full)
    flip(ranges[3][0] + fp.BLOCK + 5)  # between two sampled blocks
    changed, notes = fp.changes(before, fp.fingerprint(cfg))
    assert changed == [] and notes  # (sampled alone cannot see it, and says only that the file is touched)
    changed, _ = fp.changes(before, fp.fingerprint(full))
    assert changed == ["a.txt has other bytes at the same size (its CRC-32 differs)"]


def test_fingerprint_changes_name_files_gone_new_and_resized() -> None:
    from titanrush.data.fingerprint import METHOD, changes

    def record(**files: int) -> dict:
        entries = {f"{k}.txt": {"size": v, "mtime_ns": 1, "sampled": "0"} for k, v in files.items()}
        return {"dataset": "files", "method": METHOD, "full": False, "files": entries}

    saved = record(a=10, b=20, c=30, d=1, e=2, f=3)
    changed, notes = changes(saved, record(a=10, b=21, g=4))
    assert changed == [
        "4 files removed (c.txt, d.txt, e.txt, ... 1 more)",
        "1 file added (g.txt)",
        "b.txt has 21 bytes, 20 at the save",
    ]
    assert notes == []
    assert changes(saved, {**saved, "dataset": "shards"}) == ([], [])  # (the data position names that)
    touched = {**saved, "files": {k: {**v, "mtime_ns": 2} for k, v in saved["files"].items()}}
    changed, notes = changes(saved, touched)
    assert changed == [] and "6 files of the data changed only the modification time" in notes[0]
    changed, notes = changes({**saved, "method": "another"}, record(a=10, b=20, c=30, d=1, e=2, f=3))
    assert changed == [] and "only the files and their sizes are compared" in notes[0]


def test_fingerprint_of_each_dataset(tmp_path: Path, shards: Path) -> None:
    """embedded: the standard library's train files by size; shards: the train split's files; synthetic
    and hf: nothing."""
    from titanrush.data.fingerprint import fingerprint

    embedded = fingerprint(Data(dataset="embedded"))
    assert embedded is not None and embedded["method"] == "sizes"
    names = sources.embedded_files("train")
    assert len(embedded["files"]) == len(names) and all(
        set(e) == {"size"} for e in embedded["files"].values()
    )
    record = fingerprint(Data(dataset="shards", path=str(shards)))
    assert record is not None and "train_00000.bin" in record["files"]
    assert "train_00000.docs.npy" in record["files"]
    assert not any(name.startswith("validation") for name in record["files"])
    assert (
        fingerprint(Data(dataset="synthetic")) is None and fingerprint(Data(dataset="hf", path="x")) is None
    )
