"""Data-layer throughput: tokenizer MB/s, `prepare` tokens/s, loader tokens/s (shards and embedded).

    python scripts/bench_data.py [--seconds 3] [--workers 2]

The corpus is the embedded one (the Python standard library sources). `prepare` reads it as one
.jsonl file written to a temporary folder; the loaders run in this process (num_workers = 0) and
with worker processes. Figures go to stdout as a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from titanrush.config import Data
from titanrush.data import Tokenizer, build_dataloader, build_tokenizer
from titanrush.data.prepare import prepare
from titanrush.data.sources import embedded_documents


def loader_rate(data: Data, tok: Tokenizer, seq_len: int, batch: int, seconds: float) -> tuple[float, float]:
    """(seconds to the first batch, tokens/s over the next `seconds`)."""
    start = time.perf_counter()
    it = iter(
        build_dataloader(data, tokenizer=tok, seq_len=seq_len, local_batch_size=batch, vocab_size=tok.n_words)
    )
    next(it)
    first = time.perf_counter() - start
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += next(it).input_ids.numel()
    return first, n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """Run every measurement and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time per loader measurement")
    parser.add_argument("--workers", type=int, default=2, help="prepare processes and loader workers")
    args = parser.parse_args(argv)
    rows: list[tuple[str, str]] = []
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs",
        file=sys.stderr,
    )

    tok = build_tokenizer("default")
    texts = [d.text for split in ("train", "validation") for d in embedded_documents(split)]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    for label, fn in [
        ("tokenizer encode, 1 thread", lambda: [tok.encode(t, bos=False, eos=False) for t in texts]),
        ("tokenizer encode_batch (tiktoken threads)", lambda: tok.encode_batch(texts, bos=False, eos=False)),
        ("tokenizer encode_arrays (numpy, threads)", lambda: tok.encode_arrays(texts)),
    ]:
        start = time.perf_counter()
        fn()
        rows.append((label, f"{mb / (time.perf_counter() - start):.1f} MB/s ({mb:.1f} MB)"))

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "stdlib.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        for workers in sorted({1, args.workers}):
            start = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):
                index = prepare(
                    str(src), f"{tmp}/shards{workers}", workers=workers, jsonl_chunk_bytes=4 << 20
                )
            elapsed = time.perf_counter() - start
            n = sum(s["tokens"] for s in index["splits"].values())
            rows.append(
                (
                    f"prepare, {workers} worker(s)",
                    f"{n / elapsed / 1e6:.2f}M tokens/s ({n / 1e6:.1f}M tokens)",
                )
            )

        shards = f"{tmp}/shards{args.workers}"
        for seq_len, batch in [(256, 8), (2048, 8), (8192, 1)]:
            for workers in (0, args.workers):
                data = Data(dataset="shards", path=shards, num_workers=workers)
                _, rate = loader_rate(data, tok, seq_len, batch, args.seconds)
                rows.append(
                    (f"loader shards T={seq_len} B={batch} workers={workers}", f"{rate / 1e6:.1f}M tokens/s")
                )

        cache = f"{tmp}/cache"
        for label, cache_dir in [("cold, no cache", ""), ("cache written", cache), ("cache hit", cache)]:
            first, rate = loader_rate(Data(cache_dir=cache_dir), tok, 2048, 8, args.seconds)
            rows.append(
                (
                    f"loader embedded T=2048 B=8 ({label})",
                    f"first batch {first:.2f}s, {rate / 1e6:.1f}M tokens/s",
                )
            )
        for workers in (0, args.workers):
            data = Data(cache_dir=cache, num_workers=workers)
            _, rate = loader_rate(data, tok, 256, 8, args.seconds)
            rows.append((f"loader embedded T=256 B=8 workers={workers}", f"{rate / 1e6:.1f}M tokens/s"))

    print("| measurement | result |\n| --- | --- |")
    for label, value in rows:
        print(f"| {label} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
