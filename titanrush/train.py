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


def start_flash_warm_up(cfg: cfgmod.JobConfig, argv: list[str]) -> bool:
    """flash-attn-4's kernels compiled by a child beside this process's start-up (started before torch
    and the trainer are imported), where the config runs flash attention at fixed shapes (no pipeline,
    no context parallel) and FA4's disk cache is on; the child, `--flash-warm-up` with the same
    arguments, works the shapes out as the trainer does. Whether it started."""
    from titanrush.models import flash_warm_up

    p = cfg.parallelism
    flash_warm_up.enable_disk_cache()
    if cfg.model.attn_backend != "flash" or p.pp > 1 or p.cp > 1 or not flash_warm_up.disk_cache_enabled():
        return False
    flash_warm_up.hand_over(flash_warm_up.WarmUpProcess(__name__, ["--flash-warm-up", *argv]))
    return True


def flash_warm_up_child(argv: list[str]) -> int:
    """The child of start_flash_warm_up: this rank's shapes (its GPU, LOCAL_RANK; the CPU where there is
    none) from the training arguments, the warm-up at them, and the shapes printed as JSON; `none` where
    flash-attn-4 does not run (FA3 and FA2 ship compiled kernels)."""
    import os

    import torch

    from titanrush.models.flash_warm_up import to_json
    from titanrush.models.llama.attention import flash_kernels, warm_up
    from titanrush.trainer import check_config, flash_shapes

    path, _, overrides = split_args(argv)
    cfg = cfgmod.load(path, overrides)
    dims, args, _ = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    shapes = flash_shapes(cfg, dims, args, device)
    try:
        if flash_kernels() is None:
            shapes = None
    except ImportError:
        shapes = None
    if shapes is not None:
        warm_up(shapes)
    print(to_json(shapes) if shapes is not None else "none")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--flash-warm-up"]:
        return flash_warm_up_child(argv[1:])
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        print(cfgmod.help_text())
        return 0
    init_logging()
    try:
        path, check, overrides = split_args(argv)
        cfg = cfgmod.load(path, overrides)
        if not check:
            start_flash_warm_up(cfg, argv)
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
