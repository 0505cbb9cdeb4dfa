"""File-system faults of long runs (issue #48), each reproduced on CPU against the real trainer and tools.

A full disk while metrics.jsonl is written stops the run with one line and leaves only whole rows; a cut-off
last row is repaired when the run starts again. A run refused at start (a full disk, metrics.jsonl that is
a folder) leaves no lock file and no folder behind, and holds no lock. A checkpoint file or step folder
this user may not read, a data shard of random bytes, a checkpoint shard of random bytes under `--check`
and a renamed step folder are bad input: exit status 2 and one line naming the path and the fix, nothing
changed. `generate` and `convert` racing the pruning of the step they read take the newest step left, or
say that the step they were given was removed.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from faults import CKPT, assert_one_line, build, run_args, snapshot, train

from titanrush.checkpoint import integrity
from titanrush.interop import hf
from titanrush.run.run_dir import RunLock
from titanrush.tools import convert, generate
from titanrush.train import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_log_handler() -> None:
    """`main` sets up titanrush's log handler once per process; each test's own is made anew."""
    logging.getLogger("titanrush").handlers.clear()


@pytest.fixture
def warned() -> list[str]:
    """The warnings titanrush logs in the test (where `generate` and `convert` show them: stderr)."""
    logger, lines = logging.getLogger("titanrush"), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the one-layer model, 8 steps cut off after step 4, full checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("tiny")
    train(run_args(dump, "src", 8, *CKPT), stop_at=4)
    return dump / "src"


@pytest.fixture
def run(tiny: Path, tmp_path: Path) -> Path:
    """This test's own copy of `tiny`, as tmp_path/src (continue it with run_args(tmp_path, 'src', ...))."""
    return Path(shutil.copytree(tiny, tmp_path / "src"))


def _args(run: Path, steps: int = 8, *extra: str) -> list[str]:
    return run_args(run.parent, run.name, steps, *CKPT, *extra)


def _rows(path: Path) -> list[dict]:
    """Every row of a JSON-lines file, each a whole JSON object on a line of its own."""
    text = path.read_text()
    assert text.endswith("\n"), repr(text[-200:])
    return [json.loads(line) for line in text.splitlines()]


def _error(err: str) -> str:
    """The line `titanrush: ...error: ...` of what a command printed (the training log comes before it)."""
    lines = [x for x in err.splitlines() if x.startswith("titanrush")]
    assert lines and "Traceback" not in err, err[-3000:]
    assert_one_line(lines[-1])
    return lines[-1]


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _names_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------
# 1. A full disk while metrics.jsonl is written; a cut-off last row


def _disk_fills_while_writing(monkeypatch, name: str, rows: int) -> None:
    """Writes into the file `name` take `rows` writes, then half of the next and fail with ENOSPC, as a
    disk that fills up does (the kernel takes what fits, then refuses)."""
    real = os.write
    state = {"writes": 0}

    def write(fd: int, data) -> int:
        if not _names_of(fd).endswith(os.sep + name):
            return real(fd, data)
        state["writes"] += 1
        if state["writes"] <= rows:
            return real(fd, data)
        if state["writes"] == rows + 1:
            return real(fd, bytes(data[: len(data) // 2]))
        raise _enospc()

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_while_writing_metrics_stops_in_one_line_and_leaves_whole_rows(
    tmp_path, monkeypatch, capsys
):
    """metrics.jsonl used to end in a cut-off row, the run in two chained tracebacks (the write, then the
    close flushing it again), and the next attempt's first row was written onto the cut-off one."""
    args = run_args(tmp_path, "run", 8, *CKPT)
    ck = tmp_path / "run" / "checkpoint"
    with monkeypatch.context() as m:
        _disk_fills_while_writing(m, "metrics.jsonl", rows=3)  # steps 1 and 2, step 2's checkpoint; not 3
        status = main(args)
    err = _error(capsys.readouterr().err)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert status == 1
    assert err.startswith(f"titanrush: error: cannot write {metrics} (No space left on device): "), err
    assert "every row in the file is whole" in err and "is full" in err and "free space" in err, err
    rows = _rows(metrics)
    assert [(r["step"], "loss" in r) for r in rows] == [(1, True), (2, True), (2, False)]
    assert sorted(p.name for p in ck.iterdir()) == ["step-2"]  # the last complete checkpoint, kept
    assert integrity.verify(ck / "step-2", integrity.read_record(ck / "step-2")) == []
    # Space freed, the same command resumes from step 2; every row is whole and none was lost.
    assert main(args) == 0
    rows = _rows(metrics)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["attempt"] for r in rows if "loss" in r] == [1, 1, 2, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("last", ["cut-off", "without-newline"])
def test_a_cut_off_last_row_is_repaired_when_the_run_starts_again(run, last, capsys):
    """A machine that went down mid-write (or an older titanrush on a full disk) left the last row cut
    off; the next attempt used to append its first row onto it."""
    metrics = run / "metrics.jsonl"
    before = metrics.read_text()
    torn = '{"step": 5, "attempt": 1, "loss": 9.1' if last == "cut-off" else '{"step": 5, "attempt": 1}'
    metrics.write_text(before + torn)
    assert main(_args(run)) == 0
    rows = _rows(metrics)
    kept = before + ("" if last == "cut-off" else torn + "\n")
    assert metrics.read_text().startswith(kept)  # every whole row kept, the cut-off one removed
    assert [r["step"] for r in rows if r.get("attempt") == 2 and "loss" in r] == [5, 6, 7, 8]
    said = capsys.readouterr().err
    assert (f"{metrics} ended in a cut-off row" in said) == (last == "cut-off")


# --------------------------------------------------------------------------------------------------
# 2. Refused at start: no lock file, no folder, no lock held


@pytest.mark.parametrize("folder", ["new", "existing"])
def test_a_full_disk_at_start_is_refused_leaving_no_lock_file_or_folder(run, folder, monkeypatch, capsys):
    """The run folder's lock records its holder: on a full disk that write fails first. A new folder used to
    be left behind with its `.lock` (the next run: 'exists'); an existing one stopped in a traceback."""
    target = run.parent / "new" / "run" if folder == "new" else run
    (run / ".lock").unlink()  # (an existing folder of a run from before locks: the lock file is new)
    before = snapshot(run)
    real = os.pwrite

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if _names_of(fd).endswith(os.sep + ".lock"):
            raise _enospc()
        return real(fd, data, offset)

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", pwrite)
        status = main(run_args(target.parent, target.name, 8, *CKPT))
    err = _error(capsys.readouterr().err)
    assert status == 2
    assert err.startswith(f"titanrush: config error: cannot write the run folder {target} ("), err
    assert err.endswith("free space on its disk, or choose a job.dump_folder on another disk"), err
    assert snapshot(run) == before and not (run / ".lock").exists()
    if folder == "new":
        assert not (run.parent / "new").exists()  # nor its parent, which the run made too
    else:
        lock = RunLock()
        assert lock.acquire(run) == ""  # nothing holds it
        lock.release(refused=True)


def test_metrics_jsonl_that_is_a_folder_is_refused_before_anything_is_written(run, capsys):
    """It used to stop in an IsADirectoryError traceback after config.toml was rotated, leaving `.lock`."""
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    (run / ".lock").unlink()
    before = snapshot(run)
    assert main(_args(run)) == 2
    err = _error(capsys.readouterr().err)
    assert err == (
        f"titanrush: config error: {run / 'metrics.jsonl'} is not a file (a folder, a link, a pipe ...); "
        "remove it, or choose another job.name"
    )
    assert snapshot(run) == before and not (run / ".lock").exists()


# --------------------------------------------------------------------------------------------------
# 3. A checkpoint file or step folder this user may not read


@functools.cache
def _as_a_user() -> list[str] | str:
    """The command prefix under which permission bits apply to a child (none needed for a user); for root,
    which reads through them, the capabilities that let it dropped (`setpriv`: the interpreter under
    /root stays reachable, as it would not for another uid). A string: why it cannot be done here."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if not shutil.which("setpriv"):
        return "root reads through permission bits, and there is no setpriv to drop that"
    with tempfile.TemporaryDirectory() as folder:
        closed = Path(folder, "closed")
        closed.write_text("x")
        closed.chmod(0)
        probe = subprocess.run([*prefix, "cat", str(closed)], capture_output=True, text=True)
    if "Permission denied" not in probe.stderr:
        return f"root's file capabilities cannot be dropped here: {probe.stderr.strip()[:100]}"
    return prefix


CHILD = r"""
import contextlib, io, json, logging, sys, traceback
from titanrush.tools.convert import main as convert
from titanrush.train import main as train

for name, tool, argv in json.loads(sys.argv[1]):
    logging.getLogger("titanrush").handlers.clear()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = (train if tool == "train" else convert)(argv)
        except BaseException:
            traceback.print_exc()
            status = None
    print(json.dumps([name, status, err.getvalue()]), flush=True)
"""

UNREADABLE = {  # case: (what is made unreadable, under checkpoint/step-4; the command; its extra flags)
    "shard": ("__0_0.distcp", "train", []),
    "shard --check": ("__0_0.distcp", "train", ["--check"]),
    ".metadata": (".metadata", "train", []),
    "titanrush.json": ("titanrush.json", "train", []),
    "step folder": ("", "train", []),
    "step folder --check": ("", "train", ["--check"]),
    "shard, convert": ("__0_0.distcp", "convert", []),
}


@pytest.mark.skipif(isinstance(_as_a_user(), str), reason=str(_as_a_user()))
def test_an_unreadable_checkpoint_file_or_step_folder_is_refused_in_one_line(tiny, tmp_path):
    """Each used to end in a long traceback from the integrity check (or be called corrupt); now one line
    naming the path and the fix, exit status 2, nothing changed. One child process runs every case."""
    cases, made = [], {}
    for i, (case, (name, tool, extra)) in enumerate(UNREADABLE.items()):
        run = Path(shutil.copytree(tiny, tmp_path / f"case{i}" / "src"))
        target = run / "checkpoint" / "step-4" / name
        made[case] = (run, target, snapshot(run), target.stat().st_mode)
        if tool == "train":
            argv = run_args(run.parent, "src", 8, *CKPT, *extra)
        else:
            argv = ["--to-pt", str(run / "checkpoint" / "step-4"), str(tmp_path / f"case{i}" / "out.pt")]
        cases.append((case, tool, argv))
        target.chmod(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        res = subprocess.run(
            [*_as_a_user(), sys.executable, "-c", CHILD, json.dumps(cases)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for _, target, _, mode in made.values():
            target.chmod(mode)
    assert res.returncode == 0, res.stderr[-3000:]
    for case, status, err in (json.loads(line) for line in res.stdout.splitlines()):
        run, target, before, _ = made[case]
        step = run / "checkpoint" / "step-4"
        prefix = "titanrush convert: error: " if case.endswith("convert") else "titanrush: config error: "
        what = "cannot be read" if case.endswith("convert") else "cannot be loaded"
        assert status == 2, (case, err)
        assert_one_line(err.strip())
        assert err.strip() == (
            f"{prefix}checkpoint {step} {what}: {target} cannot be read by this user (Permission denied): "
            f"give yourself read access (chmod -R u+rX {step})"
        ), (case, err)
        after = snapshot(run)
        assert {k: v for k, v in after.items() if k != ".lock"} == {
            k: v for k, v in before.items() if k != ".lock"
        }, case


# --------------------------------------------------------------------------------------------------
# 4. Shards of random bytes of the right length


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of shards that `titanrush prepare` wrote from 200 short documents."""
    from titanrush.data.prepare import main as prepare

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "seven", "owls"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) for _ in range(200)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert (
        prepare(["--input", str(root / "docs.jsonl"), "--output", str(root / "shards"), "--workers", "1"])
        == 0
    )
    return root / "shards"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_data_shard_of_random_bytes_stops_with_exit_2_and_its_message_alone(
    shards, workers, tmp_path, capsys
):
    """Found while training (the ids read are past the vocabulary): it used to end in a traceback, exit
    status 1; from a loader worker the message held the worker's traceback too."""
    folder = Path(shutil.copytree(shards, tmp_path / "shards"))
    shard = folder / "train_00000.bin"
    shard.write_bytes(np.random.default_rng(1).bytes(shard.stat().st_size))
    data = ["--data.dataset", "shards", "--data.path", str(folder), "--data.num_workers", str(workers)]
    assert main(run_args(tmp_path, "run", 4, *data)) == 2
    err = _error(capsys.readouterr().err)
    assert err.startswith(f"titanrush: config error: {shard}: token id "), err
    assert err.endswith(">= the model's vocab_size 8192; the shard is corrupt, re-run prepare"), err


def test_a_checkpoint_shard_of_random_bytes_without_a_record_is_refused_by_check(run, capsys):
    """Without an integrity record (as `titanrush convert` writes): the trainer said corrupt or unreadable,
    `--check` ended in an UnpicklingError traceback, exit status 1."""
    step = run / "checkpoint" / "step-4"
    (step / integrity.RECORD_FILE).unlink()
    info = json.loads((step / "titanrush.json").read_text())
    (step / "titanrush.json").write_text(json.dumps({k: v for k, v in info.items() if k != "integrity"}))
    shard = step / "__0_0.distcp"
    shard.write_bytes(np.random.default_rng(2).bytes(shard.stat().st_size))
    before = snapshot(run)
    for check in (["--check"], []):
        assert main(_args(run, 8, *check)) == 2, check
        err = _error(capsys.readouterr().err)
        assert err.startswith(f"titanrush: config error: checkpoint {step} is corrupt or unreadable: "), err
        assert err.endswith(f"by moving this one aside (mv {step} {step}.bad) or deleting it"), err
    assert {k: v for k, v in snapshot(run).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


# --------------------------------------------------------------------------------------------------
# 5. generate and convert racing the pruning of the step they read


def _pruned_while_read(monkeypatch, victim: Path, at: str) -> None:
    """The step folder `victim` is deleted (as a training run's keep_latest_k prunes it) when the reader
    first calls `at` of titanrush.interop.hf: `verify` (the integrity check) or `dcp.load` (the weights)."""
    owner, name = (hf, "verify") if at == "verify" else (hf.dcp, "load")
    real = getattr(owner, name)

    def pruned_first(*args, **kwargs):
        shutil.rmtree(victim, ignore_errors=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, pruned_first)


def _read(tool: str, checkpoint: Path, out: Path) -> int:
    if tool == "convert":
        return convert.main(["--to-pt", str(checkpoint), str(out)])
    return generate.main(["--checkpoint", str(checkpoint), "--prompt", "the", "--max-new-tokens", "2"])


@pytest.mark.parametrize("tool, at", [("convert", "verify"), ("convert", "dcp.load"), ("generate", "verify")])
def test_a_reader_racing_pruning_reads_the_newest_step_left(run, tool, at, monkeypatch, capsys, warned):
    """Given the checkpoint folder, the reader took step-4, which the run pruned while it was read: it used
    to end in a FileNotFoundError traceback or call the healthy checkpoint corrupt."""
    ck = run / "checkpoint"
    out = run.parent / "model.pt"
    with monkeypatch.context() as m:
        _pruned_while_read(m, ck / "step-4", at)
        assert _read(tool, ck, out) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert warned == [
        f"{ck / 'step-4'} was removed while it was being read (the run that writes {ck} pruned it: "
        "checkpoint.keep_latest_k); reading the newest checkpoint left there"
    ]
    if tool == "convert":
        assert torch.load(out)["step"] == 2


@pytest.mark.parametrize("tool", ["convert", "generate"])
def test_a_step_named_by_the_user_and_pruned_while_read_is_said_to_be_removed(run, tool, monkeypatch, capsys):
    ck = run / "checkpoint"
    with monkeypatch.context() as m:
        _pruned_while_read(m, ck / "step-4", "verify")
        assert _read(tool, ck / "step-4", run.parent / "model.pt") == 2
    err = capsys.readouterr().err.strip()
    assert_one_line(err)
    assert err == (
        f"titanrush {tool}: error: checkpoint {ck / 'step-4'} was removed while it was being read (the run "
        f"that writes {ck} prunes its older checkpoints: checkpoint.keep_latest_k); read one that is kept "
        f"({ck / 'step-2'} is the newest), or pass the checkpoint folder {ck} to read its newest"
    )
    assert not (run.parent / "model.pt").exists()


# --------------------------------------------------------------------------------------------------
# 6. A step folder renamed


def test_a_renamed_step_folder_is_refused_naming_both_steps(run, capsys):
    """step-4 moved to step-8 used to load, resume 'after step 4', train, and then blame 'another run'
    when its save of step 8 met the folder."""
    ck = run / "checkpoint"
    os.replace(ck / "step-4", ck / "step-8")
    before = snapshot(run)
    for check in (["--check"], []):
        assert main(_args(run, 12, *check)) == 2, check
        err = _error(capsys.readouterr().err)
        assert err == (
            f"titanrush: config error: checkpoint {ck / 'step-8'} holds step 4 (its titanrush.json), not "
            f"step 8 as its name says: the folder was renamed or copied; rename it back (mv {ck / 'step-8'} "
            f"{ck / 'step-4'})"
        )
    assert {k: v for k, v in snapshot(run).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }
    # A copy beside the original: moving it aside is the fix.
    shutil.copytree(ck / "step-8", ck / "step-4")
    assert main(_args(run, 12)) == 2
    err = _error(capsys.readouterr().err)
    assert err.endswith(f"move it aside (mv {ck / 'step-8'} {ck / 'step-8'}.bad): step-4 exists beside it"), (
        err
    )
    os.replace(ck / "step-8", ck / "step-8.bad")  # the fix works: the run resumes from step 4
    trainer = build(_args(run, 12))
    assert trainer.step == 4
    trainer.close()
