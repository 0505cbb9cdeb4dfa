"""Entry point: `python -m titanrush.train [--config FILE] [--section.key value ...]`.

Exit status: 0 on success, 2 on a config error (before any model is built), 1 on other failures.
"""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from titanrush import bytecode
from titanrush import config as cfgmod
from titanrush.config import ConfigError
from titanrush.logging_utils import init_logging

if TYPE_CHECKING:
    from titanrush.models.flash_warm_up import WarmUpProcess

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


MODULE = "titanrush.train"  # this module's name also where it runs as __main__ (`python -m`)


def start_flash_warm_up(cfg: cfgmod.JobConfig, argv: list[str]) -> WarmUpProcess | None:
    """flash-attn-4's kernels compiled by a child beside this process's start-up (started before torch
    and the trainer are imported), where the config runs flash attention at fixed shapes (no pipeline,
    no context parallel) and FA4's disk cache is on; the child, `--flash-warm-up` with the same
    arguments, works the shapes out as the trainer does."""
    from titanrush.models import flash_warm_up

    p = cfg.parallelism
    if cfg.model.attn_backend != "flash" or p.pp > 1 or p.cp > 1:
        return None
    flash_warm_up.enable_disk_cache()
    if not flash_warm_up.disk_cache_enabled():
        return None
    return flash_warm_up.WarmUpProcess(MODULE, ["--flash-warm-up", *argv])


def flash_warm_up_child(argv: list[str]) -> int:
    """The child of start_flash_warm_up: this rank's shapes (on its GPU, LOCAL_RANK, or on the CPU where
    there is none) from the training arguments, with no more than the model's flavor (no trainer, no
    tokenizer); the warm-up at them and the report (none where flash-attn-4 does not run: FA3 and FA2
    ship compiled kernels)."""
    import os

    import torch

    from titanrush.models.flash_warm_up import rank_shapes, warm_up_and_report
    from titanrush.models.llama import model_args
    from titanrush.models.llama.attention import flash_kernels

    path, _, overrides = split_args(argv)
    cfg = cfgmod.load(path, overrides)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    t, p = cfg.training, cfg.parallelism
    shapes = rank_shapes(
        model_args(cfg.model.flavor), device=device, batch=t.local_batch_size, seq_len=t.seq_len,
        tp=p.tp, pp=p.pp, cp=p.cp, in_graph=cfg.model.flash_in_graph,
    )  # fmt: skip
    try:
        if flash_kernels() is None:
            shapes = None
    except ImportError:
        shapes = None
    return warm_up_and_report(shapes)


def main(argv: list[str] | None = None) -> int:
    # Python's automatic garbage collector off from launch: torch's imports, the model build and the
    # compile create millions of long-lived objects, and the collector's full passes over them cost
    # about a third of the import time. The trainer collects once before step 1 and then every
    # training.gc_freq steps; with gc_freq 0 (automatic) it is switched back on once the config is read.
    enabled = gc.isenabled()
    gc.disable()
    pycache = bytecode.enable()  # before torch's sources are compiled, also by the processes started below
    try:
        return _main(sys.argv[1:] if argv is None else argv, pycache)
    finally:
        gc.enable() if enabled else gc.disable()  # as it was, for a caller in the same process


def _main(argv: list[str], pycache: Path | None = None) -> int:
    if argv[:1] == ["--flash-warm-up"]:
        return flash_warm_up_child(argv[1:])
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        print(cfgmod.help_text())
        return 0
    init_logging()
    if pycache is not None:
        logging.getLogger(MODULE).info(f"bytecode: kept under {pycache} (torch's installed has none usable)")
    try:
        path, check, overrides = split_args(argv)
        cfg = cfgmod.load(path, overrides)
    except ConfigError as e:
        print(f"titanrush: config error: {e}", file=sys.stderr)
        return 2
    if cfg.training.gc_freq == 0:
        gc.enable()
    child = None if check else start_flash_warm_up(cfg, argv)
    try:
        return _check_or_train(cfg, check, child)
    finally:
        if child is not None:  # stopped where it still runs, reaped where nobody waited for it
            child.kill()


def _check_or_train(cfg: cfgmod.JobConfig, check: bool, child: WarmUpProcess | None) -> int:
    import os

    from titanrush.trainer import Trainer, check_config

    try:
        if check:
            check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
            print("config OK")
            return 0
        trainer = Trainer(cfg, flash_child=child)
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
