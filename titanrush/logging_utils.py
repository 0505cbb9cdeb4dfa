"""Logging set-up: one stream handler, rank-aware."""

from __future__ import annotations

import logging
import os


def init_logging() -> None:
    """INFO on rank 0, WARNING elsewhere; every line carries the rank when several processes run."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank{rank}] " if world > 1 else ""
    logger = logging.getLogger("titanrush")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
