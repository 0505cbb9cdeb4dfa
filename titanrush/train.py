"""Entry point: `python -m titanrush.train [--config FILE] [--section.key value ...]`.

Exit status: 0 on success, 2 on a config error (before any model is built), 1 on a `RunError` (a run
stopped for a reason outside the config, such as a full disk: one line on stderr) and other failures.
"""

from __future__ import annotations

import gc
import sys

from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.errors import RunError
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
    # Python's automatic garbage collector off from launch: torch's imports, the model build and the
    # compile create millions of long-lived objects, and the collector's full passes over them cost
    # about a third of the import time. The trainer collects once before step 1 and then every
    # training.gc_freq steps; with gc_freq 0 (automatic) it is switched back on once the config is read.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    finally:
        gc.enable() if enabled else gc.disable()  # as it was, for a caller in the same process


def _main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        print(cfgmod.help_text())
        return 0
    init_logging()
    try:
        path, check, overrides = split_args(argv)
        cfg = cfgmod.load(path, overrides)
    except ConfigError as e:
        print(f"titanrush: config error: {e}", file=sys.stderr)
        return 2
    if cfg.training.gc_freq == 0:
        gc.enable()
    return _check_or_train(cfg, check)


def _check_or_train(cfg: cfgmod.JobConfig, check: bool) -> int:
    from titanrush.distributed import ranks_from_env
    from titanrush.plan import build_plan
    from titanrush.trainer import Trainer

    try:
        plan = build_plan(cfg, ranks_from_env().world_size)
        if check:
            print("config OK")
            return 0
        trainer = Trainer(cfg, plan)
    except ConfigError as e:
        print(f"titanrush: config error: {e}", file=sys.stderr)
        return 2
    try:
        try:
            trainer.train()
        finally:
            trainer.close()
    except RunError as e:  # a run stopped for a reason outside the config (a full disk, ...)
        print(f"titanrush: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
