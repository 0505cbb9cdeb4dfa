"""Entry point: `python -m titanrush.train [--config FILE] [--section.key value ...]`.

Exit status (docs/operations.md):
  0        the run reached training.steps
  1        a run stopped for a reason outside the config (a full disk during a save, out of memory:
           one line naming the fix; another rank gone: one line), or another failure (a traceback)
  2        a config error: one line naming the key, before anything is built or written (a plan the
           memory estimate says does not fit the GPU too, with the nearest plan that fits:
           docs/auto_plan.md); or bad input met while training (a corrupt data shard): one line naming
           the file and the fix
  3        a non-finite loss or gradient norm stopped the run (training.on_nonfinite): one line naming
           the step; nothing of that step was saved
  4        a hang: a step did not finish within training.step_timeout (titanrush/run/watchdog.py): every
           thread's stack on stderr and in <run folder>/hang/, one line naming the step, the phase and
           the collective waited in; the launcher's last line names the rank that stalled
  128 + N  signal N stopped the run after a step (143: SIGTERM, 130: SIGINT), with a checkpoint of that
           step when checkpoint.enable and checkpoint.save_on_signal; a second signal after a SIGINT
           stops at once (130)

Under the launcher (a job of several processes), job.max_restarts > 0 starts the job again after a
failure (1, 4, a worker killed by a signal other than SIGTERM/SIGINT), never after 0, 2, 3 or a stop by
signal; the restarted job resumes from the newest complete checkpoint (titanrush/run/launch.py).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

from titanrush import config as cfgmod
from titanrush.config import ASSUME_CUDA, ConfigError
from titanrush.errors import RunError
from titanrush.launch_env import Ranks, ranks_from_env
from titanrush.logging_utils import ConsoleCopy, init_logging, run_heading
from titanrush.run.validate import check_values

if TYPE_CHECKING:
    from titanrush.run.autoplan import Choice
    from titanrush.run.plan import RunPlan

USAGE = """usage: titanrush train [--config FILE] [--check [--assume-cuda]] [--section.key value
                       | --section.key=value | --section.key | --no-section.key ...]
       titanrush train --help [SECTION | WORD]

Trains a Llama from a TOML config (defaults < TOML < command line). --check validates the config, the
data, the checkpoint to load and the output folders, and exits. On a machine without CUDA a config that
needs GPUs is refused; --check --assume-cuda checks it as on the GPUs (plan.gpu_mem_gib: their memory).
Lists are comma-separated. --help lists every key (the sections last); --help SECTION one section's,
--help WORD the keys whose name holds WORD.
"""


def main(argv: list[str] | None = None) -> int:
    # Python's automatic garbage collector off from launch: torch's imports, the model build and the
    # compile create millions of long-lived objects, and the collector's full passes over them cost
    # about a third of the import time. The trainer collects once before step 1 and then every
    # training.gc_freq steps; with gc_freq 0 (automatic) it is switched back on once the config is read.
    started = time.perf_counter()  # (the run's summary counts its wall time from here)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _main(sys.argv[1:] if argv is None else argv, started)
    finally:
        gc.enable() if enabled else gc.disable()  # as it was, for a caller in the same process


def _main(argv: list[str], started: float) -> int:
    if "-h" in argv or "--help" in argv:
        return _help(argv)
    assume_cuda = ASSUME_CUDA in argv
    try:
        cfg, check, overrides = cfgmod.load_command(argv)
        check_values(cfg)  # (before torch's import: a bad value is said at once)
        ranks = ranks_from_env()
    except ConfigError as e:
        print(f"titanrush: config error: {e}", file=sys.stderr)
        return 2
    init_logging(verbose=cfg.metrics.verbose)  # before torch's import: its warnings follow the policy
    if ranks.rank == 0:
        for line in cfgmod.repeated_overrides(overrides):
            logging.getLogger("titanrush").warning(line)
    if cfg.training.gc_freq == 0:
        gc.enable()
    from titanrush.distributed import set_allocator_env  # (torch's import after the config's checks)

    # Before anything starts CUDA (the plan's machine checks may): the allocator reads it at start-up.
    set_allocator_env(os.environ, expandable=cfg.training.expandable_segments)
    if check or ranks.rank != 0:
        return _check_or_train(cfg, check, ranks, Launch(argv, started), assume_cuda=assume_cuda)
    console = ConsoleCopy()  # rank 0's console, into the run folder once it exists (console.log)
    console.start()
    try:
        return _check_or_train(cfg, check, ranks, Launch(argv, started, console))
    except Exception:  # (a crash: Python prints the traceback once the copy has ended; the copy gets it too)
        console.note(traceback.format_exc())
        raise
    finally:
        console.close()


def _help(argv: list[str]) -> int:
    """`--help`: every key; `--help TOPIC` (the argument after it, where it is no flag): what TOPIC names."""
    at = argv.index("-h") if "-h" in argv else argv.index("--help")
    topic = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
    try:
        text = cfgmod.help_text(topic=topic)
    except ConfigError as e:
        print(f"titanrush: {e}", file=sys.stderr)
        return 2
    print(USAGE)
    print(text)
    return 0


NONFINITE_STATUS = 3
OOM_FIX = (
    "The run does not fit this device: `titanrush estimate` with the same config shows where the memory "
    "goes; lower training.local_batch_size or training.seq_len, set activation_checkpoint.mode, shard "
    "over more GPUs, or check the model's size (model.vocab_size, model.dim, model.n_layers)"
)


def out_of_memory(e: BaseException) -> str | None:
    """What an allocation failure says (a GPU's first line, or the host allocator's), else None."""
    import torch

    text = str(e).strip() or type(e).__name__
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return text.splitlines()[0]
    at = text.find("DefaultCPUAllocator: can't allocate memory")
    return text[at:].split(". Error code")[0] if at >= 0 else None


def lost_peer(e: BaseException, rank: int) -> str | None:
    """The line for a collective that failed because another rank is gone (gloo's transport: a connection
    closed, reset or timed out; torch's network errors), without gloo's source path; else None."""
    import torch.distributed as dist

    text = str(e).strip()
    if not (isinstance(e, dist.DistNetworkError) or "gloo/transport/" in text):
        return None
    what = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(e).__name__)
    return (
        f"titanrush: error: rank {rank} lost another rank of the job, which ended or hung (the "
        f"launcher's last line names the first to end): {what.split('. ')[0]}"
    )


def _interrupted(e: BaseException) -> bool:
    """Whether `e` was raised while a KeyboardInterrupt was being handled (its `__context__` chain)."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        if isinstance(at, KeyboardInterrupt):
            return True
        seen.add(id(at))
        at = at.__context__
    return False


@dataclasses.dataclass
class Launch:
    """How this process was started: its arguments, when (`time.perf_counter()`), and rank 0's console
    copy (None on the other ranks)."""

    argv: list[str]
    started: float
    console: ConsoleCopy | None = None


def _check_or_train(
    cfg: cfgmod.JobConfig, check: bool, ranks: Ranks, launch: Launch, *, assume_cuda: bool = False
) -> int:
    import torch

    from titanrush import distributed
    from titanrush.run.memory_check import plan_run
    from titanrush.run.nonfinite import NonFiniteError
    from titanrush.run.preflight import check_files
    from titanrush.run.run_dir import CONSOLE_FILE
    from titanrush.run.signals import end_with_launcher
    from titanrush.run.summary import command_line, command_prefix
    from titanrush.run.validate import config_warnings
    from titanrush.trainer import Trainer

    say = (
        (lambda line: print(f"titanrush: {line}", file=sys.stderr))
        if ranks.rank == 0
        else (lambda line: None)
    )
    said_lost = False
    try:
        try:
            # Auto levers chosen for this GPU's memory, and the plan held to it, before anything is built;
            # the resolved config is the run's (its config.toml): a rerun is the same run.
            choice = plan_run(cfg, ranks.world_size, local_rank=ranks.local_rank, assume_cuda=assume_cuda)
            cfg, plan = choice.cfg, choice.plan
            if check:  # (quiet: the run itself logs what the data and checkpoint hold)
                logging.getLogger("titanrush").setLevel(logging.WARNING)
                said = [*check_files(cfg, plan), *config_warnings(cfg)]
                for line in said:  # (stdout: the launcher's check is quiet)
                    print(f"warning: {line}")
                if cfg.plan.probe and (first := _shortlist(choice)):
                    print(f"plan.probe = {cfg.plan.probe}: the run measures these first: {'; '.join(first)}")
                ok = "config OK"
                if assume_cuda and not torch.cuda.is_available():
                    gpus = f"{ranks.world_size} CUDA GPU{'s' if ranks.world_size > 1 else ''}"
                    ok += f" as on {gpus} of {choice.gpu_note}"
                print("\n".join([*choice.report(), ok]))
                return 0
            for line in choice.report():
                logging.getLogger("titanrush").info(line)
            end_with_launcher()  # a worker of a launcher killed from here on ends too
            if cfg.plan.probe:  # the top plans measured on these GPUs, the fastest kept (config.toml)
                choice = _probe(choice, ranks.rank)
                cfg, plan = choice.cfg, choice.plan
            trainer = Trainer(cfg, plan)
        except ConfigError as e:  # (found by the trainer, e.g. a checkpoint that does not fit this run)
            print(f"titanrush: config error: {e}", file=sys.stderr)
            distributed.destroy()  # left up, gloo may abort the process at exit
            return 2
        except RunError as e:  # (the processes did not connect, ...)
            print(f"titanrush: error: {e}", file=sys.stderr)
            distributed.destroy()
            return 1
        launcher = command_prefix(world_size=ranks.world_size)
        console = None
        if launch.console is not None:  # the run is accepted: its folder exists
            heading = run_heading(trainer.attempt, trainer.step, command_line(launcher, launch.argv))
            launch.console.attach(trainer.run_dir / CONSOLE_FILE, heading)
            console = launch.console.path  # (None where the file cannot be written)
        for line in config_warnings(cfg) if ranks.rank == 0 else []:  # the run is accepted: once
            logging.getLogger("titanrush").warning(line)
        try:
            try:
                trainer.train()
                trainer.summarize(
                    started=launch.started, launcher=launcher, args=launch.argv, console=console
                )
            except NonFiniteError as e:  # every rank stops at the same step; rank 0 says why
                # Said, and waited for, before close(): a rank that ended first would have the launcher
                # stop rank 0 before its line.
                say(f"stopped: {e}")
                distributed.barrier()
                return NONFINITE_STATUS
            except RuntimeError as e:
                if (lost := lost_peer(e, ranks.rank)) is None:
                    raise
                # Said before close() gives SIGTERM its default action back: torchrun stops the ranks
                # left a moment after the first one ends.
                print(lost, file=sys.stderr)
                said_lost = True
                return 1
            finally:
                trainer.close()  # (waits for a save in flight: a full disk may surface here)
        except ConfigError as e:  # bad input met while training (a data shard of random bytes)
            print(f"titanrush: config error: {e}", file=sys.stderr)
            return 2
        except RunError as e:  # a run stopped for a reason outside the config (a full disk, ...)
            print(f"titanrush: error: {e}", file=sys.stderr)
            return 1
    except (MemoryError, RuntimeError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
        if _interrupted(e) and lost_peer(e, ranks.rank) is not None:
            # A second Ctrl-C, then close() waited on a collective that the other ranks, stopping at
            # once too, had left: the interrupt is what happened.
            say("interrupted: stopped at once, nothing saved (exit status 130)")
            return 128 + signal.SIGINT
        if (what := out_of_memory(e)) is not None:
            print(f"titanrush: error: out of memory on rank {ranks.rank}: {what}. {OOM_FIX}", file=sys.stderr)
        elif (lost := lost_peer(e, ranks.rank)) is not None:  # (in the set-up, or in close())
            if not said_lost:
                print(lost, file=sys.stderr)
        else:
            raise
        distributed.destroy()
        return 1
    except KeyboardInterrupt:  # before the loop's handler is in place, or a second Ctrl-C
        say("interrupted: stopped at once, nothing saved (exit status 130)")
        return 128 + signal.SIGINT
    if trainer.stopped_by is not None:
        say(trainer.stop_reason)
        return 128 + trainer.stopped_by
    return 0


def _shortlist(choice: Choice) -> list[str]:
    """The plans `plan.probe` would measure (two or more), in words."""
    from titanrush.run.probe import shortlist

    found = shortlist(choice, choice.given.plan.probe)
    return [c.label() for c in found] if len(found) > 1 else []


def _probe(choice: Choice, rank: int) -> Choice:
    """`plan.probe`: the top plans of the auto levers trained for a few steps each by the trainer itself
    (`titanrush.run.probe`), the fastest kept; the process group stays up for the run."""
    import torch

    from titanrush.run import probe
    from titanrush.trainer import Trainer

    log = logging.getLogger("titanrush")
    k = choice.given.plan.probe
    if not choice.levers:
        log.warning(f"plan.probe = {k}: no lever is auto (activation_checkpoint.mode, ...): nothing to probe")
        return choice

    def train_one(cfg: cfgmod.JobConfig, plan: RunPlan) -> float:
        trainer = Trainer(cfg, plan)
        try:
            trainer.train()
        finally:
            trainer.close(end_process_group=False)
        return probe.tokens_per_s(trainer.run_dir) if rank == 0 else 0.0

    def measure(cfg: cfgmod.JobConfig, plan: RunPlan) -> tuple[float | None, str]:
        level = log.level
        log.setLevel(logging.ERROR)  # (the probe's set-up and steps: its table says what they measured)
        try:
            result: tuple[float | None, str] = (train_one(cfg, plan), "ok")
        except (MemoryError, RuntimeError) as e:
            if (what := out_of_memory(e)) is None:
                raise
            result = (None, f"out of memory: {what}")
        finally:
            log.setLevel(level)
        # The probe's trainer is gone with train_one's frame (and the error's traceback): free its memory
        # before the next one, and let the run compile its own model afresh, as without a probe.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch.compiler.reset()
        return result

    kept, measured = probe.run(choice, measure, rank=rank)
    if not measured:
        log.info(f"plan.probe = {k}: fewer than two plans fit, nothing to probe")
        return choice
    for line in probe.report(measured, kept.chosen, choice.given.plan.probe_steps):
        log.info(line)
    return kept


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
