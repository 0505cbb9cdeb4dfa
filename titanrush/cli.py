"""The `titanrush` console script: `titanrush <command> [args]`."""

from __future__ import annotations

import difflib
import gc
import importlib
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

# command -> (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("titanrush.train", "train a model (single process; ./run_train.sh launches several)"),
    "tokenizer": ("titanrush.data.make_tokenizer", "train a BPE tokenizer on text files, or import one"),
    "prepare": ("titanrush.data.prepare", "tokenize text files into binary shards"),
    "convert": ("titanrush.tools.convert", "convert checkpoints to/from Hugging Face Llama folders and .pt"),
    "generate": (
        "titanrush.tools.generate",
        "continue a prompt with a checkpoint's model (greedy or top-p)",
    ),
    "estimate": ("titanrush.tools.estimate", "will this config fit, and what uses the memory"),
    "rush": ("titanrush.tools.rush", "measure what each optimization buys (ladder, dist, moe)"),
    "sweep": ("titanrush.tools.sweep", "run mesh shapes (tp/pp/cp/...) and rank them"),
    "plot": ("titanrush.tools.plot", "a PNG of a run's metrics (loss, tokens/s, MFU, memory, experts)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: titanrush <command> [args]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        near = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        print(f"titanrush: unknown command {name!r}; {hint}commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


def in_flags(message: str, flags: dict[str, str]) -> str:
    """A message of the training config's checks in a tool's own words: each config key the tool sets
    from a flag (`data.tokenizer` -> `--tokenizer`) named as that flag."""
    for key, flag in flags.items():
        message = message.replace(f"{key} = ", f"{flag} ").replace(key, flag)
    return message


def exit_program(main: Callable[[], int]) -> NoReturn:
    """Run a titanrush command as a program (`main` returns its exit status) and end the process with it.

    A reader that stops reading (`| head -1` closed the pipe) ends the command quietly, with exit status
    141 (128 + SIGPIPE, what a shell gives a program that SIGPIPE ends): there is no one left to tell.
    Python's own recipe (the signal module's note on SIGPIPE) points stdout at /dev/null for the
    interpreter's last flush; SIGPIPE's default action is not restored, as it would end a training run
    whose socket to another rank broke, without a word.

    What the command made goes with the process: gc.freeze() spares the interpreter's final garbage
    collection over every object of torch, the model and the compiler (2-5 s at the end of each short CPU
    run; the files are closed by then).
    """
    try:
        try:
            status = main()
        finally:  # (also after SystemExit: argparse's --help) what is still buffered, while it can fail here
            sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):  # (either may be the closed pipe: `2>&1 | head`)
            os.dup2(devnull, stream.fileno())
        status = 128 + signal.SIGPIPE
    gc.freeze()
    sys.exit(status)


def run() -> NoReturn:
    """The `titanrush` console script."""
    exit_program(main)


if __name__ == "__main__":
    exit_program(main)
