"""Helpers of the parallel tests: run the real trainer as one process or as several ranks (gloo, CPU) and
read its metrics.jsonl.

Every run trains the debug model shrunk to a few CPU-seconds a step: seq_len 64, a global batch of 4
sequences whatever the mesh (local batch = 4 / dp), fp32, deterministic algorithms, a metrics row per
step. The data layer gives the same global batch for any dp degree, so a parallel run and the single
process see the same tokens and must agree up to floating-point reassociation.

A test module's runs are folded into one launch per number of processes (`Cases`, `cases_probe.py`): the
runs themselves are unchanged, but the start-up of the processes (most of a short run's time on CPU) is
paid once per launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
GLOBAL_BATCH = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """CPU only, one thread per process (2 cores host up to 4 ranks), the checkout importable."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def spawn(entry: list[str], nproc: int, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python ENTRY` as `nproc` ranks of one gloo job on this host, with the environment torchrun gives
    its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) but without the
    launcher, whose own start-up (importing torch, the rendezvous) adds seconds to every test; as torchrun
    does, a rank that fails stops the others. Tests of the launch itself (run_train.sh, multi-node, signals,
    the console) use torchrun. Returns the exit status (the first failure's; -9 past `timeout`) and every
    rank's output."""
    cmd, port = [sys.executable, *entry], str(free_port())
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(nproc)]
        procs: list[subprocess.Popen] = []
        try:
            for rank, log in enumerate(logs):
                ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc}
                env = {
                    **child_env(),
                    **{k: str(v) for k, v in ranks.items()},
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                }
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            while None in (codes := [p.poll() for p in procs]) and time.monotonic() < deadline:
                if any(codes):  # a rank failed: stop the others
                    break
                time.sleep(0.05)
            failed = [c for c in codes if c]
            status = failed[0] if failed else -9 if None in codes else 0
        finally:  # (also when the test is interrupted: no rank is left waiting for its peers)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        output = []
        for rank, log in enumerate(logs):
            log.seek(0)
            output.append(f"--- rank {rank}:\n{log.read()}")
    return subprocess.CompletedProcess(cmd, status, "".join(output), "")


def train_args(dump: Path, name: str, dp: int, *overrides: str) -> list[str]:
    """The shrunk debug run, with `overrides` last (they win)."""
    return [
        "--job.dump_folder",
        str(dump),
        "--job.name",
        name,
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        str(GLOBAL_BATCH // dp),
        "--training.global_batch_size",
        str(GLOBAL_BATCH),
        "--training.deterministic",
        "--training.precision",
        "fp32",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--no-metrics.tensorboard",
        "--training.gc_freq",
        "0",
        *overrides,
    ]


def read_metrics(run_dir: Path, rank: int = 0) -> list[dict]:
    path = run_dir / ("metrics.jsonl" if rank == 0 else f"metrics_rank{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(dump: Path, name: str, nproc: int, *overrides: str, dp: int | None = None) -> list[dict]:
    """Train in `nproc` processes (several: `spawn`); return rank 0's metrics rows, whatever steps ran."""
    run_ok(["-m", "titanrush.train", *train_args(dump, name, nproc if dp is None else dp, *overrides)], nproc)
    return read_metrics(dump / name)


def run_ok(entry: list[str], nproc: int) -> None:
    """`spawn` (one process: WORLD_SIZE 1, no process group), failing the test with the ranks' errors."""
    res = spawn(entry, nproc)
    assert res.returncode == 0, failure(res.args, res.stdout)


def run_train(dump: Path, name: str, nproc: int, *overrides: str, dp: int | None = None) -> list[dict]:
    """Train in `nproc` processes (several: `spawn`) and return the metrics rows of rank 0.

    Args:
        dump: The dump folder; the run writes `dump/name/metrics.jsonl`.
        name: The job name.
        nproc: Processes on this host.
        overrides: Extra `--section.key value` arguments.
        dp: The data-parallel degree (sets the local batch so that the global batch stays fixed);
            defaults to nproc.
    """
    rows = launch(dump, name, nproc, *overrides, dp=dp)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return rows


def failure(cmd: list[str], log: str) -> str:
    """The command, the lines that name the error (whichever rank hit it first), and the log's tail."""
    keys = ("Error", "error:", "terminate", "what()", "Assertion", "Traceback", "Signal")
    hits = [line for line in log.splitlines() if any(k in line for k in keys)]
    return "\n".join([" ".join(cmd), "--- error lines:", *hits[:60], "--- tail:", log[-4000:]])


def max_rel_dev(rows: list[dict], ref: list[dict], key: str) -> float:
    """The largest relative deviation of `key` over the steps."""
    return max(abs(r[key] - q[key]) / abs(q[key]) for r, q in zip(rows, ref, strict=True))


PROBE = ROOT / "tests" / "parallel" / "cases_probe.py"


def run_cases(nproc: int, cases: list[tuple[str, str, list[str]]], tmp: Path) -> dict[str, str | None]:
    """Run `cases` ([name, kind, args], see `cases_probe.py`) in order in `nproc` processes, as few launches
    as it takes: a case that fails ends its launch, and the cases after it run in the next one.

    Returns:
        Each case's outcome: None where it ran through, else the failure (the launch's error lines).
    """
    outcome: dict[str, str | None] = {}
    pending = list(cases)
    while pending:
        n = len(outcome)
        spec, done = tmp / f"cases{n}.json", tmp / f"cases{n}.done"
        spec.write_text(json.dumps({"cases": pending, "done": str(done)}))
        res = spawn([str(PROBE), str(spec)], nproc, timeout=300 + 120 * len(pending))
        finished = done.read_text().split() if done.exists() else []
        outcome |= dict.fromkeys(finished)
        pending = [c for c in pending if c[0] not in outcome]
        if pending:  # the first case that did not finish failed (or the launch did)
            status = f"(exit status {res.returncode}; launch of {[c[0] for c in pending]})"
            name = pending.pop(0)[0]
            outcome[name] = failure([*res.args, status], from_case(res.stdout, name))
        elif res.returncode != 0:  # every case ran through, but the processes did not end cleanly
            raise AssertionError(failure(res.args, res.stdout))
    return outcome


def from_case(log: str, name: str) -> str:
    """`spawn`'s output of every rank from where case `name` of `cases_probe.py` started."""
    marker, out = f"=== case {name}\n", []
    for part in log.split("--- rank ")[1:]:
        head, _, body = part.partition("\n")
        out.append(f"--- rank {head}\n{body[body.find(marker) :] if marker in body else body}")
    return "".join(out)


@dataclass
class Case:
    """One run of a launch of `cases_probe.py`: its processes, the kind of run and its arguments."""

    nproc: int
    args: list[str]
    kind: str = "train"
    needs: tuple[str, ...] = ()  # cases that must have run before this one (a checkpoint they save)


class Reference:
    """Single-process runs of the shrunk debug config, one per set of overrides, each trained once per
    session (several per launch where a module asks for them together: `prefetch`)."""

    def __init__(self, dump: Path) -> None:
        self.dump, self.rows, self.count = dump, {}, 0

    def __call__(self, *overrides: str) -> list[dict]:
        self.prefetch([overrides])
        return self.rows[overrides]

    def prefetch(self, sets: Iterable[tuple[str, ...]], extra: list[tuple[str, str, list[str]]] = ()) -> dict:
        """Train the missing references of `sets` in one launch, then the single-process cases `extra`
        after them; return the outcome of `extra` (`run_cases`)."""
        refs: dict[str, tuple[str, ...]] = {}
        for overrides in dict.fromkeys(tuple(x) for x in sets):
            if overrides not in self.rows:
                refs[f"ref{self.count}"], self.count = overrides, self.count + 1
        cases = [(name, "train", train_args(self.dump, name, 1, *over)) for name, over in refs.items()]
        if not cases and not extra:
            return {}
        tmp = Path(tempfile.mkdtemp(prefix="launch", dir=self.dump))
        outcome = run_cases(1, [*cases, *extra], tmp)
        for name, overrides in refs.items():
            assert outcome[name] is None, outcome[name]
            rows = read_metrics(self.dump / name)
            assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
            self.rows[overrides] = rows
        return {name: outcome[name] for name, _, _ in extra}


class Cases:
    """A test module's runs, folded into one launch per number of processes, which runs when a test first
    asks for one of its cases (in the order they were added). Single-process cases run in the launch of
    the references that `refs` names (first), through the session's `reference`."""

    def __init__(self, dump: Path, reference: Reference | None = None, refs: Iterable[tuple[str, ...]] = ()):
        self.dump, self.reference, self.refs = dump, reference, [tuple(r) for r in refs]
        self.cases: dict[str, Case] = {}
        self.outcome: dict[str, str | None] = {}
        self.started: set[int] = set()

    def add(
        self, name: str, nproc: int, *overrides: str, dp: int | None = None, needs: Iterable[str] = ()
    ) -> str:
        """A trainer run as `run_train` would launch it (`dp` defaults to `nproc`); returns its name."""
        args = train_args(self.dump, name, nproc if dp is None else dp, *overrides)
        self.cases[name] = Case(nproc, args, needs=tuple(needs))
        return name

    def add_probe(self, name: str, nproc: int, kind: str, args: list[str]) -> str:
        """A probe run (`kind` "cp" or "ep": `cp_probe.py`, `ep_probe.py`) with its own arguments."""
        self.cases[name] = Case(nproc, args, kind=kind)
        return name

    def run(self, name: str) -> None:
        """Make sure that `name` has run (with every case of its launch); fail with its error if it failed."""
        self.launch(self.cases[name].nproc)
        assert self.outcome[name] is None, self.outcome[name]

    def ref(self, *overrides: str) -> list[dict]:
        """The session's reference run with these overrides (trained with this module's single-process
        cases where it is one of `refs`)."""
        self.launch(1)
        return self.reference(*overrides)

    def launch(self, nproc: int) -> None:
        """Run the cases of `nproc` processes, once, after those of other launches that they need."""
        if nproc in self.started:
            return
        self.started.add(nproc)
        group = {k: c for k, c in self.cases.items() if c.nproc == nproc}
        for need in {n for c in group.values() for n in c.needs if n not in group}:
            self.launch(self.cases[need].nproc)
        cases = [(k, c.kind, c.args) for k, c in group.items()]
        try:
            if nproc == 1 and self.reference is not None:
                self.outcome |= self.reference.prefetch(self.refs, extra=cases)
            elif cases:
                tmp = Path(tempfile.mkdtemp(prefix=f"launch{nproc}_", dir=self.dump))
                self.outcome |= run_cases(nproc, cases, tmp)
        except AssertionError as e:  # (a reference failed, or the processes did not end cleanly)
            self.outcome |= {k: str(e) for k in group if k not in self.outcome}

    def rows(self, name: str, rank: int = 0) -> list[dict]:
        """The metrics rows that `name` logged (rank 0's, or another rank's with metrics.all_ranks)."""
        self.run(name)
        return read_metrics(self.dump / name, rank)

    def train(self, name: str) -> list[dict]:
        """Like `run_train`: the rows of rank 0, which must be those of every step."""
        rows = self.rows(name)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
        return rows
