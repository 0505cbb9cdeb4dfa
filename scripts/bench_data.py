"""Data-layer throughput: tokenizer MB/s, `prepare` tokens/s, loader tokens/s (shards and embedded).

    python scripts/bench_data.py [--seconds 2] [--repeat 3] [--workers 2]

The corpus is the embedded one (the Python standard library sources). `prepare` reads it as one
.jsonl file written to a temporary folder; the loaders run in this process (num_workers = 0) and
with worker processes. Each figure is the best of --repeat runs (the machine may be shared).
Figures go to stdout as a Markdown table.
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from titanrush.config import Data
from titanrush.data import Tokenizer, build_dataloader, build_tokenizer
from titanrush.data.prepare import prepare
from titanrush.data.sources import embedded_documents


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Shortest wall time of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def loader_rate(data: Data, tok: Tokenizer, seq_len: int, batch: int, seconds: float) -> tuple[float, float]:
    """(seconds to the first batch, tokens/s over the next `seconds`)."""
    start = time.perf_counter()
    loader = build_dataloader(
        data, tokenizer=tok, seq_len=seq_len, local_batch_size=batch, vocab_size=tok.n_words
    )
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += next(it).input_ids.numel()
    return first, n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """Run every measurement and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per loader measurement")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (the best is kept)")
    parser.add_argument("--workers", type=int, default=2, help="prepare processes and loader workers")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {load:.1f}"
    )
    rows: list[tuple[str, str]] = []

    tok = build_tokenizer("default")
    texts = [d.text for split in ("train", "validation") for d in embedded_documents(split)]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    for label, fn in [
        ("tokenizer encode (1 thread)", lambda: [tok.encode(t, bos=False, eos=False) for t in texts]),
        ("tokenizer encode_batch (8 threads)", lambda: tok.encode_batch(texts, bos=False, eos=False)),
        ("tokenizer encode_arrays (2 threads, numpy)", lambda: tok.encode_arrays(texts, num_threads=2)),
    ]:
        rows.append((label, f"{mb / best_time(fn, args.repeat):.1f} MB/s ({mb:.1f} MB)"))

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "stdlib.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        for workers in sorted({1, args.workers}):
            out = f"{tmp}/shards{workers}"

            def run(workers: int = workers, out: str = out) -> None:
                with contextlib.redirect_stderr(io.StringIO()):
                    prepare(str(src), out, workers=workers, overwrite=True, jsonl_chunk_bytes=4 << 20)

            seconds = best_time(run, args.repeat)
            n = sum(s["tokens"] for s in json.loads(Path(out, "index.json").read_text())["splits"].values())
            rows.append(
                (
                    f"prepare, {workers} worker(s)",
                    f"{n / seconds / 1e6:.2f}M tokens/s ({n / 1e6:.1f}M tokens)",
                )
            )

        def loader_row(label: str, data: Data, seq_len: int, batch: int) -> None:
            runs = [loader_rate(data, tok, seq_len, batch, args.seconds) for _ in range(args.repeat)]
            first, rate = min(r[0] for r in runs), max(r[1] for r in runs)
            rows.append((label, f"{rate / 1e6:.1f}M tokens/s (first batch {first:.2f}s)"))

        shards = f"{tmp}/shards{args.workers}"
        for seq_len, batch in [(256, 8), (2048, 8), (8192, 1)]:
            for workers in (0, args.workers):
                data = Data(dataset="shards", path=shards, num_workers=workers)
                loader_row(f"loader shards T={seq_len} B={batch} workers={workers}", data, seq_len, batch)
        loader_row("loader embedded T=2048 B=8, no cache", Data(cache_dir=""), 2048, 8)
        cache = f"{tmp}/cache"
        loader_rate(Data(cache_dir=cache), tok, 256, 8, 0.0)  # writes the cache
        for seq_len, batch in [(256, 8), (2048, 8)]:
            for workers in (0, args.workers):
                data = Data(cache_dir=cache, num_workers=workers)
                loader_row(
                    f"loader embedded T={seq_len} B={batch} workers={workers}, cached", data, seq_len, batch
                )

    print("| measurement | result |\n| --- | --- |")
    for label, value in rows:
        print(f"| {label} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
