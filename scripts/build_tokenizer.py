"""Build the default tokenizer: byte-level BPE learned from the embedded corpus's train split.

    python scripts/build_tokenizer.py [--ranks 7936] [--output titanrush/data/assets/titanrush_bpe.tiktoken]

Writes tiktoken's rank-file format (`base64(token) rank` per line). With the 256 Llama 3 special
tokens that `titanrush.data.tokenizer` appends, the default 7936 ranks give a vocabulary of 8192. Built
from the Python 3.11 standard library; another Python gives a slightly different (equally valid) table.
"""

from __future__ import annotations

import argparse
import base64
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from titanrush.data.bpe import count_words, train_bpe
from titanrush.data.sources import embedded_documents
from titanrush.data.tokenizer import DEFAULT_PATH, build_tokenizer


def main(argv: list[str] | None = None) -> int:
    """Train the BPE, write the rank file, and check that it round-trips the corpus."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=7936, help="BPE ranks: 256 bytes + merges")
    parser.add_argument("--output", type=Path, default=DEFAULT_PATH, help="rank file to write")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    texts = [doc.text for doc in embedded_documents("train")]
    words = count_words(texts)
    t1 = time.perf_counter()
    print(
        f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f}M chars of the Python "
        f"{platform.python_version()} stdlib; {len(words)} unique words ({t1 - t0:.1f}s)"
    )
    ranks = train_bpe(words, args.ranks)
    t2 = time.perf_counter()
    print(f"trained {len(ranks) - 256} merges in {t2 - t1:.1f}s")
    if len(ranks) != args.ranks:
        print(f"error: the corpus only supports {len(ranks)} ranks", file=sys.stderr)
        return 1

    args.output.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"{base64.b64encode(tok).decode()} {rank}\n"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    args.output.write_text("".join(lines))
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e3:.0f} kB)")

    tok = build_tokenizer(str(args.output))
    sample = "\n".join(texts[:50])
    ids = tok.encode(sample, bos=True, eos=True)
    assert tok.decode(ids[1:-1]) == sample, "round trip failed"
    print(
        f"vocabulary {tok.n_words}; {len(sample.encode()) / (len(ids) - 2):.2f} bytes per token on a sample"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
