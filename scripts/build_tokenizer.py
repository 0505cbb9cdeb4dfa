"""Rebuild the shipped tokenizer, `titanrush/data/assets/titanrush_bpe.tiktoken`, explicitly.

    python scripts/build_tokenizer.py [--output FILE]

The same BPE as `titanrush tokenizer --vocab-size 8192` (7936 ranks + the 256 Llama 3 special tokens),
learned from the embedded corpus's train split, written as a rank file. Without --output it overwrites
the shipped file in the checkout: the one place that writes into the package (`titanrush tokenizer`
refuses to). Built from the Python 3.11 standard library; another Python gives a slightly different
(equally valid) table, and tokenized caches and shards are keyed by the file's hash.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from titanrush.data.bpe import rank_file_text
from titanrush.data.make_tokenizer import train_ranks, train_texts
from titanrush.data.tokenizer import DEFAULT_PATH, build_tokenizer

VOCAB_SIZE = 8192


def main(argv: list[str] | None = None) -> int:
    """Train the BPE, write the rank file, and check that it has the shipped size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_PATH, help="rank file to write")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    ranks = train_ranks(train_texts([]), VOCAB_SIZE)
    if len(ranks) + 256 != VOCAB_SIZE:
        print(f"error: the corpus only supports {len(ranks)} ranks", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(rank_file_text(ranks))
    tok = build_tokenizer(str(args.output))
    print(f"wrote {args.output}: {tok.n_words} ids in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
