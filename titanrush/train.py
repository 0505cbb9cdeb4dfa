"""Entry point: `python -m titanrush.train [--config FILE] [--section.key value ...]`.

Exit status: 0 on success, 2 on a config error (before any model is built), 1 on other failures.
"""

from __future__ import annotations

import sys

from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.logging_utils import init_logging

USAGE = """usage: titanrush train [--config FILE] [--check] [--section.key value | --section.key=value
                       | --section.key | --no-section.key ...]

Trains a Llama from a TOML config (defaults < TOML < command line). --check validates the config and
exits. Lists are comma-separated.
"""


def split_args(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """Pull --config FILE and --check out of argv; the rest are overrides."""
    path, check, rest = None, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg == "--job.config_file":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file path")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--check":
            check = True
        else:
            rest.append(arg)
        i += 1
    return path, check, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        print(cfgmod.help_text())
        return 0
    init_logging()
    try:
        path, check, overrides = split_args(argv)
        cfg = cfgmod.load(path, overrides)
        if not check:  # flash-attn-4's kernels compiled by a child beside this process's start-up
            from titanrush.models.flash_warm_up import start_at_launch

            start_at_launch(cfg, argv)
        import os

        from titanrush.trainer import Trainer, check_config

        if check:
            check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
            print("config OK")
            return 0
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"titanrush: config error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
