"""Errors of a run that the user can act on but that are not config errors.

`ConfigError` (titanrush.config) is bad input, found before anything is built: the CLI prints it on one
line and exits 2. `RunError` is a run that cannot go on for a reason outside the config, found while it
runs (a full disk during a checkpoint save, ...): its message says what happened, what was cleaned up and
what to do; the CLI prints it on one line and exits 1.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run stopped for a reason outside the config; the message names the cause and the fix."""
