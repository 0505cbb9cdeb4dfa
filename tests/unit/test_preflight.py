"""`titanrush train --check` (run by run_train.sh before it launches several processes) refuses what the
run would refuse at start-up: missing data, an empty validation split, a checkpoint to load that is not
there or not complete, folders that cannot be written. One line, exit status 2, nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from titanrush import train


def check(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--check",
        "--job.dump_folder",
        str(tmp_path / "runs"),
        "--job.name",
        "job",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        *extra,
    ]


def error_of(err: str) -> str:
    """stderr without the warnings for keys that `extra` sets again over `check`'s (the last one counts)."""
    return "\n".join(x for x in err.strip().splitlines() if "is given twice on the command line" not in x)


def refused(tmp_path: Path, capsys, *extra: str) -> str:
    """The one line --check prints for `extra`; the run folder was not made."""
    assert train.main(check(tmp_path, *extra)) == 2
    err = error_of(capsys.readouterr().err)
    assert err.startswith("titanrush: config error: ") and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "runs" / "job").exists()
    return err


def test_a_runnable_config_passes_and_writes_no_run_folder(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("".join(f"document {i} has a few words.\n\n" for i in range(400)))
    files = ["--data.dataset", "files", "--data.path", str(tmp_path / "corpus.txt")]
    assert train.main(check(tmp_path, *files, "--checkpoint.enable")) == 0
    assert capsys.readouterr().out.strip() == "config OK"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--data.dataset", "files", "--data.path", "{tmp}/missing.txt"], "no such file or folder"),
        (["--data.dataset", "shards", "--data.path", "{tmp}"], "not found"),
        (["--checkpoint.load_path", "{tmp}/missing"], "does not exist; check checkpoint.load_path"),
        (["--checkpoint.load_path", "{tmp}/file.txt"], "is a file, not a folder; check checkpoint.load_path"),
        (["--checkpoint.load_path", "{tmp}/step-5"], "is incomplete"),
        (["--checkpoint.load_path", "{tmp}/run"], "its checkpoints are in {tmp}/run/checkpoint: name that"),
        (
            ["--checkpoint.enable", "--checkpoint.folder", "{tmp}/file.txt/ck"],
            "so no checkpoint could be saved",
        ),
        (["--job.dump_folder", "{tmp}/file.txt"], "choose another job.dump_folder"),
        (["--job.dump_folder", "{tmp}/used"], "{tmp}/used/job/.lock is not a file (a folder, a link, a pipe"),
        (["--data.tokenizer", "{tmp}/fifo"], "is not a regular file (a pipe or a device); pass a file"),
        (
            ["--checkpoint.load_path", "{tmp}/hf"],
            "{tmp}/hf is a Hugging Face model folder, not a titanrush"
            " checkpoint: import it first (titanrush convert --from-hf {tmp}/hf OUT_DIR)",
        ),
    ],
    ids=[
        "data",
        "shards",
        "load_path",
        "load_file",
        "load_incomplete",
        "load_run",
        "ck_folder",
        "dump",
        "lock_folder",
        "tokenizer_fifo",
        "load_hf",
    ],
)
def test_what_the_run_would_refuse_at_start_is_refused_by_check(tmp_path, capsys, extra, named):
    (tmp_path / "file.txt").write_text("a file where a folder is needed")
    (tmp_path / "step-5").mkdir()
    (tmp_path / "run" / "checkpoint" / "step-2").mkdir(parents=True)
    (tmp_path / "used" / "job" / ".lock").mkdir(parents=True)  # (a folder where the lock file goes)
    os.mkfifo(tmp_path / "fifo")  # (reading it would wait forever for a writer)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")  # (a Hugging Face folder: import it first)
    err = refused(tmp_path, capsys, "--data.dataset", "synthetic", *[a.format(tmp=tmp_path) for a in extra])
    assert named.format(tmp=tmp_path) in err, err


def test_an_existing_run_folder_without_overwrite_is_refused(tmp_path, capsys):
    (tmp_path / "runs" / "job").mkdir(parents=True)
    assert train.main(check(tmp_path, "--data.dataset", "synthetic", "--no-job.overwrite")) == 2
    assert "exists and job.overwrite = false" in capsys.readouterr().err
    assert os.listdir(tmp_path / "runs" / "job") == []


def test_check_says_what_the_run_will_do_with_its_incomplete_step_folders(tmp_path, capsys):
    small = ["--data.dataset", "synthetic", "--checkpoint.enable", "--training.steps", "2"]
    small += ["--training.seq_len", "64", "--training.local_batch_size", "2"]
    assert train.main([a for a in check(tmp_path, *small) if a != "--check"]) == 0
    saved = tmp_path / "runs" / "job" / "checkpoint" / "step-2"
    (tmp_path / "runs" / "b" / "checkpoint" / "step-1").mkdir(parents=True)  # a save that never finished
    other = [*small, "--job.name", "b", "--training.steps", "4", "--checkpoint.load_path", str(saved)]
    for extra, then in [
        ([], f"resume from {saved}"),
        (["--checkpoint.load_model_only"], f"load the weights of {saved}"),
    ]:
        capsys.readouterr()
        assert train.main(check(tmp_path, *other, *extra)) == 0
        out = capsys.readouterr().out
        assert "step-1 is incomplete (it lacks" in out and f"step-1.incomplete-<n> and {then}\n" in out, out
    assert (tmp_path / "runs" / "b" / "checkpoint" / "step-1").is_dir()  # (nothing moved by --check)


def test_a_run_folder_another_run_holds_is_refused_by_check_which_leaves_the_lock(tmp_path, capsys):
    """Under NGPU=2 every rank used to print the refusal; the launcher's check now says it once."""
    from titanrush.run.run_dir import LOCK_FILE, RunLock

    folder = tmp_path / "runs" / "job"
    folder.mkdir(parents=True)
    holder = RunLock()
    assert holder.acquire(folder) == ""
    try:
        err = refused_in_place(tmp_path, capsys, "--data.dataset", "synthetic")
        assert f"run folder {folder} is in use by another run (pid {os.getpid()} on " in err, err
        assert RunLock().acquire(folder) != ""  # still held by its holder
    finally:
        holder.release()
    assert train.main(check(tmp_path, "--data.dataset", "synthetic")) == 0  # let go: the folder is free
    assert sorted(os.listdir(folder)) == [LOCK_FILE]


def refused_in_place(tmp_path: Path, capsys, *extra: str) -> str:
    """`refused`, for a run folder that exists already."""
    assert train.main(check(tmp_path, *extra)) == 2
    err = error_of(capsys.readouterr().err)
    assert err.startswith("titanrush: config error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_an_empty_validation_split_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("hello world")
    data = ["--data.dataset", "files", "--data.path", str(tmp_path / "tiny.txt"), "--validation.freq", "1"]
    err = refused(tmp_path, capsys, *data)
    assert "no text in the validation split" in err and "validation.freq = 0" in err
    # The run itself (one process: no --check first) stops at start-up too, before step 1.
    argv = [a for a in check(tmp_path, *data, "--training.steps", "2") if a != "--check"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "no text in the validation split" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "job" / "metrics.jsonl").exists()


@pytest.mark.parametrize("key", ["job.dump_folder", "checkpoint.folder"])
def test_an_empty_folder_name_is_refused(tmp_path, capsys, key):
    err = refused(tmp_path, capsys, "--data.dataset", "synthetic", f"--{key}", " ")
    assert f"{key} is empty" in err


def test_a_checkpoint_that_does_not_fit_the_run_is_refused_by_check(tmp_path, capsys):
    """The run's own checkpoint against a changed model or data stream: --check says what the trainer's
    load would say (before, only the trainer did, on every rank, after the processes had started)."""
    small = [
        "--data.dataset",
        "synthetic",
        "--checkpoint.enable",
        "--training.steps",
        "2",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
    ]
    run = [a for a in check(tmp_path, *small) if a != "--check"]
    assert train.main(run) == 0
    saved = sorted(p.name for p in (tmp_path / "runs" / "job" / "checkpoint").iterdir())
    capsys.readouterr()
    cases = [
        (["--training.seq_len", "32"], "the data loader state was saved for training.seq_len = 64"),
        (["--model.tie_embeddings", "tied"], "model: tie_embeddings is false there, true here"),
        (["--optimizer.name", "adamw8bit"], "optimizer: saved by 'adamw', this run's is 'adamw8bit'"),
    ]
    for extra, named in cases:
        assert train.main(["--check", *run, "--training.steps", "4", *extra]) == 2
        err = error_of(capsys.readouterr().err)
        assert err.startswith("titanrush: config error: checkpoint ") and "\n" not in err, err
        assert "is incompatible with this run" in err and named in err, err
    assert train.main(["--check", *run, "--training.steps", "4"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "config OK"  # (after the warm-up's warning)
    assert sorted(p.name for p in (tmp_path / "runs" / "job" / "checkpoint").iterdir()) == saved
    # a checkpoint the run would move aside as incomplete: said by --check, which moves nothing
    (tmp_path / "runs" / "job" / "checkpoint" / "step-2" / "integrity.json").unlink()
    assert train.main(["--check", *run, "--training.steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "step-2 is incomplete (it lacks integrity.json" in out and "and start from step 0" in out, out
    assert sorted(p.name for p in (tmp_path / "runs" / "job" / "checkpoint").iterdir()) == saved
