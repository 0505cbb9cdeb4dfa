"""Weights & Biases beside TensorBoard (`metrics.wandb`): rank 0 gives W&B the TensorBoard scalars of every
metrics row (`titanrush.metrics.scalars`), at the same steps.

- One W&B run per attempt of the run folder, as TensorBoard's `tb/attempt-<n>/`: the attempts of a job
  form a group named after `job.name`; its files go under `<run folder>/wandb/`.
- The x axis is the training step, logged as the `step` metric of each row (`define_metric`), not W&B's
  own step: a checkpoint's timings are logged once its save completes, after later steps' rows, and W&B
  drops a row whose own step goes back.
- Never a prompt: WANDB_MODE decides where it is set (wandb reads it); otherwise a machine with no W&B
  credentials (WANDB_API_KEY, an identity token file, or the netrc entry `wandb login` writes) logs
  offline, to files that `wandb sync <folder>` uploads later. (Logged in but the server unreachable,
  wandb.init gives up after WANDB_INIT_TIMEOUT seconds, 90 by default, and the run is refused.)

The wandb package is optional: `run.validate.check_machine` refuses `metrics.wandb` without it.
"""

from __future__ import annotations

import logging
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from titanrush.config import ConfigError
from titanrush.files import one_line

logger = logging.getLogger("titanrush")

STEP = "step"
"""The metric every other one is plotted against: the training step of the metrics row."""


# The hosts of W&B's cloud (wandb >= 0.31 names the second by default, and reads the first's key too).
DEFAULT_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def has_credentials(environ: Mapping[str, str]) -> bool:
    """Whether wandb would find credentials without asking: WANDB_API_KEY, an identity token file, or the
    netrc entry `wandb login` writes (the file NETRC names, else ~/.netrc) for the host of WANDB_BASE_URL,
    else of W&B's cloud. A key kept elsewhere is not seen: the run is then offline unless WANDB_MODE says
    otherwise (the safe side: never a prompt)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = environ.get("WANDB_BASE_URL")
    hosts = (urlsplit(base).netloc,) if base else DEFAULT_HOSTS
    path = environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(host) is not None for host in hosts)


def choose_mode(environ: Mapping[str, str]) -> str | None:
    """The mode to ask wandb.init for: None where WANDB_MODE is set (wandb honours it), else online with
    credentials, offline without (where wandb would prompt for a key, or fail without a terminal)."""
    if environ.get("WANDB_MODE"):
        return None
    return "online" if has_credentials(environ) else "offline"


class WandbSink:
    """A started W&B run: `add_scalars` logs a metrics row's scalars, `close` finishes the run; `where` says
    where it goes (its URL, or its offline folder and how to upload it)."""

    def __init__(self, run: Any, where: str = "") -> None:
        self.run = run
        self.where = where

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        if scalars:
            self.run.log({STEP: step, **scalars})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def start_wandb(
    run_dir: Path, *, project: str, name: str, job: str, attempt: int, config: dict[str, Any]
) -> WandbSink:
    """Start the W&B run of this attempt, its files under `<run_dir>/wandb/`.

    Args:
        run_dir: The run folder (made already).
        project: metrics.wandb_project.
        name: metrics.wandb_name, or '' for `job`.
        job: job.name: the group of the run's attempts.
        attempt: The run folder's attempt; a later one adds `-attempt-<n>` to the name.
        config: The resolved job config, recorded as the W&B run's config.

    Raises:
        ConfigError: wandb.init failed (a server that cannot be reached, a refused key): the run is refused
            at start, as for a metrics.jsonl that cannot be opened, with the settings that fix it.
    """
    import wandb

    mode = choose_mode(os.environ)
    name = name or job
    try:
        run = wandb.init(
            project=project,
            name=name if attempt == 1 else f"{name}-attempt-{attempt}",
            group=job,
            dir=str(run_dir),
            config=config,
            mode=mode,
            settings=wandb.Settings(quiet=True),
        )
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
    except Exception as e:  # (any failure to start: wandb.errors.Error, its service's, the network's)
        raise ConfigError(
            f"Weights & Biases did not start ({one_line(e)}); set WANDB_MODE=offline to log to files under "
            f"{run_dir / 'wandb'} (`wandb sync` uploads them later), or metrics.wandb = false"
        ) from None
    if run.offline:
        folder = Path(run.dir).parent  # (run.dir is the run's files/ folder)
        where = f"offline in {folder}; `wandb sync {folder}` uploads it"
    else:  # (no URL: WANDB_MODE=disabled)
        where = run.url or "disabled (WANDB_MODE): nothing is logged"
    logger.info(f"Weights & Biases: run {run.name}, {where}")
    return WandbSink(run, where)
