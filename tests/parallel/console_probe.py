"""What every rank of a job meets: a library warning (twice, with the filters changed in between, as
torch.compile changes them), a warning torch logs, and titanrush's INFO and WARNING lines; run under
torchrun by test_console.py, with `--verbose` for metrics.verbose."""

from __future__ import annotations

import logging
import sys
import warnings

from titanrush.logging_utils import init_logging

init_logging(verbose="--verbose" in sys.argv)
warnings.warn("a library warning every rank meets", UserWarning, stacklevel=1)
with warnings.catch_warnings():  # resets Python's once-per-location registry
    pass
warnings.warn("a library warning every rank meets", UserWarning, stacklevel=1)
logging.getLogger("torch._inductor.probe").warning("a warning torch logs on every rank")
logging.getLogger("titanrush").info("titanrush info line")
logging.getLogger("titanrush").warning("titanrush warning line")
