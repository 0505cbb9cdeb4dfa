"""Train as `titanrush.train` does, but stop after step N as if the job were cut off there.

Usage (under torchrun or plain python): python tests/gpu/stop_at.py N [--section.key value ...]
"""

from __future__ import annotations

import sys

from titanrush import config, distributed
from titanrush.logging_utils import init_logging
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer

if __name__ == "__main__":
    init_logging()
    cfg = config.load(None, sys.argv[2:])
    trainer = Trainer(cfg, build_plan(cfg, distributed.ranks_from_env().world_size))
    try:
        trainer.train(stop_at=int(sys.argv[1]))
    finally:
        trainer.close()
