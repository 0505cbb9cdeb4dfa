"""`python -m titanrush.run.launch [torchrun's options] -m titanrush.train [args]`: what run_train.sh starts
for a job of several processes.

It is torchrun (torch.distributed.run, with its options and behaviour), except that it checks the training
config once before it starts any worker (`check_config`: a config error ends it with status 2 and the
check's one line), how it ends, and that it restarts a failed job (`job.max_restarts`).

When a worker fails, torchrun raises ChildFailedError: a traceback and a report some forty lines long, and
exit status 1 whatever the workers said. Here the launcher ends with the first failed worker's own status
(2 a config error, 3 a non-finite loss, 4 a hang, 128 + N a signal: the statuses of a one-process run, in
docs/operations.md) and one line naming it: the worker's own line, printed above, says why, or, for a
worker killed by a signal (which could print nothing), the launcher's line says so. A signal to the
launcher itself (which torchrun forwards to its workers) ends it with 128 + N, without a traceback; a
second one while the workers stop is passed on as SIGTERM by torchrun, which a worker stopping on a Ctrl-C
takes as a second Ctrl-C (titanrush/run/signals.py): it stops at once.

Restarts. torchrun's own `--max-restarts` restarts the workers after any failure, a config error or a
stop by signal included; here the launcher runs torchrun again itself, and only after a failure that a
second try can get past (`restartable`): a worker killed by a signal other than SIGTERM/SIGINT, a crash
or a lost peer (1), a hang (4). The restarted job resumes from the run's newest complete checkpoint,
as any run does; the launcher prints one line per restart, and tells the new attempt its number and
cause (`TITANRUSH_RESTART`, `TITANRUSH_RESTART_CAUSE`), which rank 0 writes into metrics.jsonl. On several
nodes, every node's launcher restarts its own workers (the others lost a peer), and they meet again in a
rendezvous of the attempt's own id, whose store the hosting node keeps for the job (`rendezvous_store`).

Hangs. A rank's step watchdog (titanrush/run/watchdog.py) ends it with status 4 and leaves its report in
torchrun's error file; a rank that never reports (stopped, or hung where its watchdog cannot run) is the
one that stalled, and the last line names it. A worker the kernel holds stopped (`kill -STOP`, state T)
cannot act on torchrun's SIGTERM, which would leave it there for torchrun's 30 s before SIGKILL:
`StoppedWorkers` kills it as soon as another worker has ended.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import runpy
import signal
import socket
import sys
import tempfile
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from titanrush.config import ConfigError, load_command
from titanrush.launch_env import RESTART_VARS
from titanrush.run.validate import check_values
from titanrush.run.watchdog import ERROR_PREFIX, HANG_STATUS

REASONS = {
    1: "an error",
    2: "a config error",
    3: "a non-finite loss or gradient norm",
    HANG_STATUS: "a hang: a step did not finish in time",
}


def describe(status: int) -> str:
    """What a titanrush worker's exit status means (train.py's statuses)."""
    if status > 128 and status - 128 in signal.valid_signals():
        return f"signal {signal.Signals(status - 128).name}"
    return REASONS.get(status, "an unknown failure")


def worker_status(exitcode: int) -> int:
    """A worker's exit status as a shell gives it: a negative exit code is a signal (-N -> 128 + N)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def restartable(exitcode: int) -> bool:
    """Whether a job whose first failed worker ended with `exitcode` (torchrun's: negative for a signal)
    is restarted: a failure, not a config error (2), a non-finite stop (3) or a stop by signal (the
    worker's own 128 + N, or killed by SIGTERM or SIGINT)."""
    if exitcode < 0:
        return -exitcode not in (signal.SIGTERM, signal.SIGINT)
    return exitcode not in (0, 2, 3) and exitcode <= 128


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The worker that ended first: (rank, torchrun's ProcessFailure).

    torchrun dates failures in whole seconds; within the first one, a worker killed by SIGKILL (from
    outside: kill -9, the kernel's out-of-memory killer) comes first, since the others' failures in that
    second (a lost connection to it) follow from it and it could say nothing itself.
    """
    first = min(f.timestamp for f in failures.values())
    same = [(rank, f) for rank, f in failures.items() if f.timestamp == first]
    return next(((r, f) for r, f in same if f.exitcode == -signal.SIGKILL), same[0])


def killed_by(number: int) -> str:
    """`killed by signal 9 (SIGKILL: a kill -9, or the host's out-of-memory killer)`."""
    name = signal.Signals(number).name if number in signal.valid_signals() else "unknown"
    how = ": a kill -9, or the host's out-of-memory killer" if number == signal.SIGKILL else ""
    return f"killed by signal {number} ({name}{how})"


def ended_line(rank: int, exitcode: int) -> str:
    """The launcher's one line on a job whose first failed worker is `rank` (exit code as torchrun gives
    it: negative for a worker killed by that signal)."""
    status = worker_status(exitcode)
    head = f"titanrush: the job ended with exit status {status}"
    if exitcode >= 0:
        return f"{head} ({describe(status)}): rank {rank} ended first, its lines above say why"
    return f"{head}: rank {rank} ended first, {killed_by(-exitcode)}"  # (it could print nothing itself)


def hang_report(failure: Any) -> dict[str, Any] | None:
    """What a worker's watchdog left in torchrun's error file (rank, step, seconds, waited), or None."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):  # (the error file's {"message": ..., "extraInfo": ...})
        message = message.get("message", "")
    if not isinstance(message, str) or not message.startswith(ERROR_PREFIX):
        return None
    try:
        return json.loads(message[len(ERROR_PREFIX) :])
    except ValueError:
        return None


def where(rank: int, report: dict[str, Any]) -> str:
    """`rank 0 waited 5 s at step 7 in forward and backward, in gloo:all_reduce on default_pg, ...`."""
    seconds, step, waited = (report.get(k, "?") for k in ("seconds", "step", "waited"))
    return f"rank {rank} waited {seconds} s at step {step} in {waited}"


def hang_cause(failures: dict[int, Any], stopped: set[int]) -> str:
    """The cause of a job that a watchdog ended (status 4): the ranks that stalled without reporting (found
    stopped by the launcher, or killed at its teardown) and where the first reporting rank waited."""
    reports = {r: hang_report(f) or {} for r, f in failures.items() if f.exitcode == HANG_STATUS}
    silent = sorted(r for r, f in failures.items() if r in stopped or (r not in reports and f.exitcode < 0))
    rank = min(reports)
    waited = where(rank, reports[rank])
    outside = sorted(r for r, x in reports.items() if not x.get("collective"))
    if not silent and outside and len(outside) < len(reports):  # (the others wait in a collective for them)
        waiting = min(set(reports) - set(outside))
        names = ", ".join(map(str, outside))
        return f"rank {names} stalled outside any collective; {where(waiting, reports[waiting])}"
    if not silent:
        return f"{waited}; every rank that ended reported a timeout: their lines above say where each waited"
    names = ", ".join(map(str, silent))
    how = (
        "the launcher found it stopped (a kill -STOP, or a debugger) and killed it"
        if set(silent) <= stopped
        else "it never reported a timeout of its own"
    )
    return f"rank {names} stalled: {how}; {waited}"


def outcome(failures: dict[int, Any], stopped: set[int]) -> tuple[int, str, bool]:
    """(exit status, the cause in words, whether a restart may follow) of a failed attempt; `stopped`: the
    ranks that `StoppedWorkers` killed."""
    if any(f.exitcode == HANG_STATUS for f in failures.values()):
        return HANG_STATUS, hang_cause(failures, stopped), True
    rank, failure = first_failure(failures)
    status = worker_status(failure.exitcode)
    if failure.exitcode < 0:
        cause = f"rank {rank} was {killed_by(-failure.exitcode)}"
    else:
        cause = f"rank {rank} ended with exit status {status} ({describe(status)}; its lines above say why)"
    return status, cause, restartable(failure.exitcode)


def final_line(failures: dict[int, Any], status: int, cause: str, restarts: int) -> str:
    """The launcher's last line on a job that ends with a failed attempt (after `restarts` restarts)."""
    after = (
        f"; it had been restarted {restarts} time{'s' * (restarts > 1)} (job.max_restarts)"
        if restarts
        else ""
    )
    if status == HANG_STATUS:
        return f"titanrush: the job ended with exit status {status} ({describe(status)}): {cause}{after}"
    rank, failure = first_failure(failures)
    return ended_line(rank, failure.exitcode) + after


def _children(pid: int) -> dict[int, str]:
    """{pid: state letter} of the processes whose parent is `pid` (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found[int(entry.name)] = fields[0]
    return found


def _rank_of(pid: int) -> int | None:
    """The RANK in a worker's environment (None where it cannot be read)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in env if v.startswith(b"RANK=") and v[5:].isdigit()), None)


class StoppedWorkers:
    """Kills (SIGKILL) the workers that the kernel holds stopped (state T) once another worker of the
    attempt has ended, checking twice a second (Linux; elsewhere it does nothing)."""

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._killed: set[int] = set()
        self._done = threading.Event()
        if sys.platform.startswith("linux"):
            threading.Thread(target=self._run, name="titanrush-stopped-workers", daemon=True).start()

    def _run(self) -> None:
        while not self._done.wait(self.period):
            try:
                self.check()
            except OSError:  # (a /proc that cannot be read: torchrun's own teardown still applies)
                continue

    def check(self) -> None:
        with self._lock:
            workers = _children(os.getpid())
            self._seen |= {p for p, state in workers.items() if state != "Z"}
            if all(workers.get(p, "Z") != "Z" for p in self._seen):
                return  # (no worker has ended)
            for pid, state in workers.items():
                if state == "T":
                    rank = _rank_of(pid)
                    os.kill(pid, signal.SIGKILL)
                    self._killed.add(-1 if rank is None else rank)

    def take(self) -> set[int]:
        """The ranks killed during the attempt that ended; the next attempt starts afresh."""
        with self._lock:
            killed, self._killed, self._seen = self._killed, set(), set()
        return killed

    def close(self) -> None:
        self._done.set()


def _is_this_host(host: str) -> bool:
    """Whether `host` names this machine (a loopback address, its name, or one of its addresses)."""
    if host == "localhost" or host in (socket.gethostname(), socket.getfqdn()):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback or _shares_address(host)
    return _shares_address(host)


def _shares_address(host: str) -> bool:
    with contextlib.suppress(OSError):
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        return bool(mine & {a[4][0] for a in socket.getaddrinfo(host, None)})
    return False


def rendezvous_store(args: Any) -> Any:
    """On the node that hosts a c10d rendezvous of several nodes: its store, started here and kept for the
    launcher's life (None elsewhere, or where another process on this node hosts it).

    torchrun makes the store anew in each run and closes it when the run ends; with restarts, the host
    node's store would close while another node's launcher still talks to it (which then fails with a
    traceback), or before that node joins the next attempt. torchrun's store shares a server that this
    process holds on the same port (`multi_tenant`), so the store lives from the first attempt to the
    last, and each attempt has a rendezvous id of its own in it.
    """
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    if not _is_this_host(host):
        return None
    try:
        return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60))
    except (RuntimeError, ValueError, TimeoutError):  # (the port is taken: another launcher hosts it)
        return None


def check_config(args: Any) -> int:
    """The training config checked once before any worker starts: 0 where it passes, else the check's own
    status (2: a config error, said on stderr in one line), so that a typo ends the job before a launch.

    It is `titanrush.train --check` for this job's world size, run in a child forked from this process:
    torch is imported once for the launcher and the check, and whatever the check starts (CUDA, to read the
    GPU's memory) ends with the child, never held by the launcher for the run's life. Only a failed check
    is shown (its stderr): the report and warnings of one that passes are the run's, which rank 0 says once
    the run starts.
    """
    script = args.training_script_args
    if not (args.module and args.training_script == "titanrush.train") or "--check" in script:
        return 0
    try:
        nproc, nodes = int(args.nproc_per_node), int(str(args.nnodes).split(":")[-1])
    except ValueError:  # (torchrun's "gpu" or "auto": a count only torchrun resolves; each worker checks)
        return 0
    world = {"WORLD_SIZE": str(nproc * nodes), "LOCAL_WORLD_SIZE": str(nproc)}
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as said:
        pid = os.fork()
        if pid == 0:
            _check_in_child(script, world, said.fileno())  # (never returns)
        try:
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        except KeyboardInterrupt:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            line = "titanrush: the launcher got SIGINT while checking the config; nothing was started\n"
            sys.stderr.write(line)
            return 128 + signal.SIGINT
        if status:
            said.seek(0)
            sys.stderr.write(said.read().decode(errors="replace"))
        return status


def _check_in_child(script: list[str], world: dict[str, str], stderr: int) -> None:
    """`titanrush.train --check SCRIPT` in the forked child, its stdout discarded and its stderr into the
    file `stderr`; the child ends with the check's status."""
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # (a Ctrl-C ends it quietly; the launcher says so)
        os.environ.update(world)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        os.dup2(stderr, 2)
        sys.argv = ["titanrush.train", "--check", *script]
        runpy.run_module("titanrush.train", run_name="__main__", alter_sys=True)  # (as `python -m` runs it)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:  # (a crash of the check: its traceback, as the run would print it)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def max_restarts(script_args: list[str]) -> int:
    """job.max_restarts of the training command's config (0 where it cannot be read: the workers report
    the config error themselves, and it is not restarted)."""
    from titanrush.config import load, split_args

    try:
        path, _, overrides = split_args(script_args)
        return max(load(path, overrides).job.max_restarts, 0)
    except (ValueError, OSError):  # (ConfigError is a ValueError)
        return 0


def parse_error(argv: list[str]) -> str | None:
    """The config error of the training command in the launcher's arguments (`-m titanrush.train ARGS`)
    that parsing and the values' checks find (a key, a type, a file, a range), or None: said before torch is
    imported."""
    at = next(
        (i for i, a in enumerate(argv) if a == "titanrush.train" and argv[i - 1] in ("-m", "--module")), 0
    )
    if not at:
        return None
    try:
        check_values(load_command(argv[at + 1 :])[0])
    except ConfigError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (error := parse_error(argv)) is not None:
        print(f"titanrush: config error: {error}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    if status := check_config(args):
        return 128 - status if status < 0 else status  # (a check killed by signal N: 128 + N)
    allowed, restarts, rdzv_id = max_restarts(args.training_script_args), 0, args.rdzv_id
    store = rendezvous_store(args) if allowed else None  # noqa: F841 (held: the server lives with it)
    stopped = StoppedWorkers()
    try:
        while True:
            try:
                run(args)
                return 0
            except ChildFailedError as e:
                if first_failure(e.failures)[1].exitcode == 0:  # (failed another way: torchrun's report)
                    raise
                status, cause, again = outcome(e.failures, stopped.take())
                if not again or restarts >= allowed:
                    print(final_line(e.failures, status, cause, restarts), file=sys.stderr)
                    return status
                restarts += 1
                print(
                    f"titanrush: restart {restarts} of {allowed} (job.max_restarts) after {cause}: the job "
                    "starts again and resumes from its newest complete checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                os.environ[RESTART_VARS[0]], os.environ[RESTART_VARS[1]] = str(restarts), cause
                args.rdzv_id = f"{rdzv_id}-restart{restarts}"  # (a node never joins the failed attempt's)
    except RendezvousError as e:  # (a node that never came, or a store that went away)
        what = str(e).splitlines()[0] if str(e) else "no detail"
        again = f" (restart {restarts} of {allowed})" if restarts else ""
        print(
            f"titanrush: the launcher could not form the job{again}: {type(e).__name__}: {what}",
            file=sys.stderr,
        )
        return 1
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        first = e.__context__ if isinstance(e.__context__, SignalException) else None
        if first is not None and first.sigval == signal.SIGINT:  # (torchrun passed it on as SIGTERM)
            again = "a second SIGINT" if e.sigval == signal.SIGINT else f"SIGINT, then {name}"
            line = f"got {again}: its workers stopped at once, without saving"
        else:
            line = f"got {name} and stopped its workers"
        print(f"titanrush: the launcher {line}", file=sys.stderr)
        # End here, with the signal's status: finalizing the interpreter after the agent was stopped by a
        # signal can abort on a thread it left joinable ("terminate called without an active exception",
        # status -6), and nothing is left to write.
        stopped.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + int(e.sigval))
    finally:
        stopped.close()


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
