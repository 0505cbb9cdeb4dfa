"""`titanrush tokenizer`: train a byte-level BPE on your text, or import a tokenizer, into a folder.

    titanrush tokenizer --output DIR [--vocab-size 8192] [--input PATH ...] [--text-field text]
    titanrush tokenizer --output DIR --from SRC [--vocab-size N]

Training writes `DIR/tokenizer.model`, a tiktoken rank file (the format of Llama 3's `tokenizer.model`):
`--vocab-size` ids in all, the 256 Llama 3 special tokens after `--vocab-size - 256` BPE ranks, learned from
the train split of `--input` (files, folders or globs of .txt/.jsonl/.parquet, as `data.path`; without
it, the embedded corpus). `--from` imports a Hugging Face `tokenizer.json` (or the folder holding one,
with its `tokenizer_config.json` and `special_tokens_map.json`) or a tiktoken rank file such as Llama 3's
`original/tokenizer.model`: checked, then copied into DIR. Either way the command loads the result as a
run would and prints the flags that train with it (`--data.tokenizer DIR --model.vocab_size N`).

It never writes into the installed titanrush package: the shipped tokenizer is rebuilt, explicitly, by
`scripts/build_tokenizer.py`. Exit status: 0 written, 2 bad input (one line; nothing written).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import titanrush
from titanrush.config import ConfigError
from titanrush.data.bpe import count_words, rank_file_text, train_bpe
from titanrush.data.sources import embedded_documents, find_files, read_documents, split_of
from titanrush.data.tokenizer import (
    FOLDER_FILES,
    NUM_SPECIAL_TOKENS,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    tokenizer_path,
)

RANK_FILE = "tokenizer.model"
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MIN_VOCAB = 256 + NUM_SPECIAL_TOKENS  # the single bytes and the special tokens


def train_texts(inputs: list[str], text_field: str = "text") -> Iterator[str]:
    """The train-split texts of `inputs` (files, folders or globs, as `data.path`), else of the embedded
    corpus; the validation split (about 1% of the documents, by key) is left out, as a run holds it out."""
    if not inputs:
        yield from (doc.text for doc in embedded_documents("train"))
        return
    for pattern in inputs:
        root, files = find_files(pattern, key="--input")
        for path in files:
            yield from (d.text for d in read_documents(path, root, text_field) if split_of(d.key) == "train")


def train_ranks(texts: Iterator[str], vocab_size: int) -> dict[bytes, int]:
    """The BPE rank table of a tokenizer of `vocab_size` ids (fewer where the text runs out of pairs).

    Raises:
        ConfigError: `vocab_size` leaves no room for the 256 bytes and the 256 special tokens, or the text
            is empty.
    """
    if vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"--vocab-size {vocab_size} is below {MIN_VOCAB}: a byte-level BPE holds the 256 bytes and "
            f"{NUM_SPECIAL_TOKENS} special tokens"
        )
    words = count_words(texts)
    if not words:
        raise ConfigError("--input holds no text to learn from (its train split is empty)")
    return train_bpe(words, vocab_size - NUM_SPECIAL_TOKENS)


def package_dir() -> Path:
    """The installed titanrush package (a tokenizer written there would be lost or shipped by accident)."""
    return Path(titanrush.__file__).resolve().parent


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an output folder inside the package, a file, or one that holds a tokenizer already."""
    where = out.expanduser().resolve()
    if where == package_dir() or where.is_relative_to(package_dir()):
        raise ConfigError(
            f"--output {out} is inside the installed titanrush package ({package_dir()}); write the "
            "tokenizer elsewhere and pass that folder as data.tokenizer (scripts/build_tokenizer.py "
            "rebuilds the shipped one)"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out} is a file; pass a folder (it gets {RANK_FILE} or tokenizer.json)")
    held = [name for name in (*FOLDER_FILES, *HF_FILES) if (out / name).exists()]
    if held and not overwrite:
        raise ConfigError(
            f"--output {out} holds a tokenizer already ({', '.join(dict.fromkeys(held))}); pass --overwrite "
            "to replace it, or another folder"
        )


def write_files(out: Path, files: dict[str, bytes]) -> None:
    """Write `files` into `out` (made if missing), each through a temporary file renamed into place; the
    tokenizer files of another kind left there by an earlier tokenizer are removed (--overwrite)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (*FOLDER_FILES, *HF_FILES):
        if name not in files and (out / name).exists():
            (out / name).unlink()
    for name, data in files.items():
        tmp = out / f".{name}.tmp-{os.getpid()}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, out / name)
        finally:
            tmp.unlink(missing_ok=True)


def import_files(src: str) -> tuple[dict[str, bytes], Tokenizer | HFTokenizer]:
    """The files of the tokenizer `src` names (a tokenizer.json or its folder: with the config files beside
    it; else a rank file: as tokenizer.model), and that tokenizer, loaded as a run would load it.

    Raises:
        ConfigError: `src` is missing, not a tokenizer, or needs the `tokenizers` package that is absent.
    """
    path = tokenizer_path(src)
    tok = build_tokenizer(str(path))  # (a ConfigError naming the file where it does not load)
    if path.suffix != ".json":
        return {RANK_FILE: path.read_bytes()}, tok
    beside = {name: (path.parent / name).read_bytes() for name in HF_FILES if (path.parent / name).exists()}
    return beside | {"tokenizer.json": path.read_bytes()}, tok


def describe(tok: Tokenizer | HFTokenizer) -> str:
    """`4096 ids (3840 BPE ranks + 256 special tokens)`, or a Hugging Face tokenizer's count."""
    if isinstance(tok, HFTokenizer):
        return f"{tok.n_words} ids (a Hugging Face tokenizer.json; BOS {tok.bos_id}, EOS {tok.eos_id})"
    return f"{tok.n_words} ids ({tok.n_ranks} BPE ranks + {tok.n_words - tok.n_ranks} special tokens)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titanrush tokenizer",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="The folder is what data.tokenizer (and titanrush prepare --tokenizer) takes.",
    )
    p.add_argument("--output", required=True, type=Path, help="folder to write the tokenizer into")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="ids of the trained tokenizer, special tokens included (default 8192); with --from, the "
        "model vocabulary the imported one must fit",
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="PATH",
        help="text to train on: a file, folder or glob of .txt/.jsonl/.parquet (repeatable; default: the "
        "embedded corpus)",
    )
    p.add_argument("--text-field", default="text", help="field with the text in .jsonl/.parquet")
    p.add_argument(
        "--from",
        dest="source",
        metavar="SRC",
        help="import instead of training: a tokenizer.json, its folder, or a tiktoken rank file (Llama 3's "
        "tokenizer.model)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --output")
    return p


def main(argv: list[str] | None = None) -> int:
    """Train or import; return the exit status (0 written, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if args.source and args.input:
            parser.error("--input trains a tokenizer, --from imports one: pass one of them")
    except SystemExit as e:  # --help or a usage error: argparse has printed it
        return int(e.code or 0)
    try:
        return _run(args)
    except ConfigError as e:
        print(f"titanrush tokenizer: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    out: Path = args.output.expanduser()
    check_output(out, args.overwrite)
    t0 = time.perf_counter()
    if args.source:
        files, tok = import_files(args.source)
        if args.vocab_size and tok.n_words > args.vocab_size:
            raise ConfigError(
                f"{args.source} has {tok.n_words} ids, more than --vocab-size {args.vocab_size}: a model of "
                "that vocabulary cannot use it; import the model's own tokenizer, or train one "
                f"(titanrush tokenizer --vocab-size {args.vocab_size} --output DIR --input YOUR_TEXT)"
            )
        did = f"imported from {args.source}"
    else:
        vocab = args.vocab_size or 8192
        where = ", ".join(args.input) or f"the embedded corpus (Python {platform.python_version()} stdlib)"
        print(f"training a {vocab}-id BPE on the train split of {where} ...", flush=True)
        ranks = train_ranks(train_texts(args.input, args.text_field), vocab)
        files = {RANK_FILE: rank_file_text(ranks).encode()}
        did = f"trained in {time.perf_counter() - t0:.1f}s"
        if len(ranks) + NUM_SPECIAL_TOKENS < vocab:
            got = len(ranks) + NUM_SPECIAL_TOKENS
            print(
                f"note: the text supports only {len(ranks) - 256} merges, so the tokenizer has {got} ids, "
                f"not {vocab} (more text gives the full size); a model vocabulary of {vocab} covers it"
            )
    write_files(out, files)
    tok = build_tokenizer(str(out))
    if not args.source:  # (the trainer's own check: byte-level BPE gives every text back)
        sample = "def f(x):\n    return {'naïve': x ** 2}  # größer, 1234\n"
        assert tok.decode(tok.encode(sample, bos=False, eos=False)) == sample, "round trip failed"
    print(f"wrote {out}: {describe(tok)}; {did}")
    vocab = max(args.vocab_size or 0, tok.n_words)  # (the size asked for covers a smaller tokenizer)
    flags = f"--data.tokenizer {out} --model.vocab_size {vocab}"
    print(f"train with it: {flags} (or any larger model.vocab_size)")
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main())
