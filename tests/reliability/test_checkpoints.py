"""Checkpoint faults, each reproduced on CPU with the real trainer, and the clear outcome each must have.

Loading: flipped bytes are *corrupt* (named file and bytes, the earlier checkpoint to use, nothing read
or touched); another model or data layout is *incompatible* (what differs, what to do), never corrupt; a
step folder that lacks a file is *incomplete*, moved aside, and the run resumes from the newest complete
one; a model-only final save falls back to the newest full checkpoint. Saving: a full disk stops the run
with exit status 1 and one line, removes the partial `.tmp` and leaves earlier checkpoints alone; an
unwritable folder is refused at start. Resuming: `training.steps` at or below the checkpoint, a changed
learning rate, and each rank's own random generators.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from faults import CKPT, assert_one_line, build, run_args, snapshot, train
from loop_helpers import spawn
from torch.distributed.checkpoint.filesystem import FileSystem

from titanrush.checkpoint import integrity
from titanrush.checkpoint.folder import move_aside
from titanrush.config import ConfigError
from titanrush.optim import lr_factor
from titanrush.train import main

ROOT = Path(__file__).resolve().parents[2]


class Said(logging.Handler):
    """The titanrush logger's messages (it does not propagate to pytest's caplog once the CLI set it up)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def find(self, text: str) -> str:
        return next((line for line in self.lines if text in line), "")


@pytest.fixture
def said():
    logger = logging.getLogger("titanrush")
    handler, level = Said(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def no_tensor_read(monkeypatch):
    """Fail the test if DCP loads any tensor (the checks must come first; reading the small objects of the
    data loader's state, which the checks compare, is allowed)."""
    from titanrush.checkpoint.compat import ObjectReader

    real = dcp.load

    def objects_only(state, *args, **kwargs):
        if not all(isinstance(v, ObjectReader) for v in state.values()):
            raise AssertionError(f"dcp.load read {sorted(state)} before the checkpoint was refused")
        return real(state, *args, **kwargs)

    monkeypatch.setattr(dcp, "load", objects_only)


# --------------------------------------------------------------------------------------------------
# Corrupt


@pytest.mark.parametrize("target", ["__0_0.distcp", ".metadata"])
def test_flipped_bytes_are_corrupt_named_and_nothing_is_read_or_touched(copy, target, monkeypatch):
    ck = copy / "checkpoint"
    path = ck / "step-4" / target
    data = bytearray(path.read_bytes())
    flip = len(data) // 2
    data[flip] ^= 0x01  # one bit: the file still unpickles and DCP would read it silently
    path.write_bytes(bytes(data))
    before = snapshot(ck)
    with monkeypatch.context() as m:
        m.setattr(dcp, "load", lambda *a, **k: pytest.fail("dcp.load ran on a corrupt checkpoint"))
        m.setattr(dcp.FileSystemReader, "read_metadata", lambda *a, **k: pytest.fail(".metadata was read"))
        with pytest.raises(ConfigError) as e:
            build(run_args(copy.parent, "src", 8, *CKPT))
    msg = str(e.value)
    assert_one_line(msg)
    start = flip // integrity.BLOCK_BYTES * integrity.BLOCK_BYTES  # the block that holds the flipped bit
    end = min(start + integrity.BLOCK_BYTES, len(data))
    assert f"step-4 is corrupt: {target} bytes {start:,}-{end:,} differ" in msg
    assert (
        f"resume from step-2, the newest earlier sound checkpoint, by moving this one aside (mv {ck}/" in msg
    )
    assert snapshot(ck) == before  # nothing moved, deleted or rewritten
    # The advice works: moved aside, the run resumes from step 2.
    os.replace(ck / "step-4", ck / "step-4.bad")
    trainer = build(run_args(copy.parent, "src", 8, *CKPT))
    assert trainer.step == 2
    trainer.close()
    # Through checkpoint.load_path the advice names the earlier checkpoint's path.
    with pytest.raises(
        ConfigError, match=rf"resume from {ck}/step-2 with --checkpoint.load_path {ck}/step-2"
    ):
        build(run_args(copy.parent, "other", 8, "--checkpoint.load_path", str(ck / "step-4.bad")))


REC, INFO, SHARD = integrity.RECORD_FILE, "titanrush.json", "__0_0.distcp"


def _edit(name: str, change, *, record: bool = False):
    """A damage that rewrites the step folder's JSON file `name` as change(its data) returns it; with
    `record`, the integrity record is made anew after it (the file as recorded: only its shape is wrong)."""

    def damage(step: Path) -> None:
        (step / name).write_text(json.dumps(change(json.loads((step / name).read_text()))))
        if record:
            integrity.record_folder(step)

    return damage


def _files(change):
    """An edit of the record's files ({name: entry}) as an edit of the record."""
    return _edit(REC, lambda rec: {**rec, "files": change(rec["files"])})


def _shard(change):
    """An edit of the shard's entry in the record."""
    return _files(lambda files: {**files, SHARD: change(files[SHARD])})


def _cut(name: str, keep: float = 0.5):
    def damage(step: Path) -> None:
        data = (step / name).read_bytes()
        (step / name).write_bytes(data[: int(len(data) * keep)])

    return damage


def _garbage(name: str, *, same_size: bool = False, record: bool = False):
    def damage(step: Path) -> None:
        size = (step / name).stat().st_size if same_size else 20
        (step / name).write_bytes((b"\x00\xffnot json " * size)[:size])
        if record:
            integrity.record_folder(step)

    return damage


def _unrecorded(damage):
    """The damage done to a checkpoint without an integrity record (as `titanrush convert` writes)."""

    def without(step: Path) -> None:
        (step / REC).unlink()
        _edit(INFO, lambda info: {k: v for k, v in info.items() if k != "integrity"})(step)
        damage(step)

    return without


# {case: (the damage done to step-4, what the refusal says of the file)}
DAMAGE = {
    "record-truncated": (_cut(REC), "integrity.json is not valid JSON ("),
    "record-empty": (_cut(REC, 0), "integrity.json is empty (0 bytes)"),
    "record-garbage": (_garbage(REC), "integrity.json is not valid JSON"),
    "record-a-list": (_edit(REC, lambda rec: [rec]), "integrity.json is not a JSON object (it holds a list)"),
    "record-without-files": (
        _edit(REC, lambda rec: {k: v for k, v in rec.items() if k != "files"}),
        "integrity.json is not a titanrush integrity record (it lacks 'files')",
    ),
    "record-files-a-list": (_files(list), "integrity.json has files ["),
    "record-entry-without-size": (
        _shard(lambda e: {"crc32": e["crc32"]}),
        "integrity.json lacks the size of ",
    ),
    "record-size-a-string": (
        _shard(lambda e: {**e, "size": str(e["size"])}),
        f'integrity.json gives {SHARD} the size "',
    ),
    "record-checksum-missing": (
        _shard(lambda e: {**e, "crc32": e["crc32"][:-1]}),
        f"crc32 checksum(s) for {SHARD}, not",
    ),
    "record-names-a-path": (
        _files(lambda files: {**files, "../../config.toml": files[INFO]}),
        "integrity.json lists '../../config.toml', which is not a file name of the checkpoint folder",
    ),
    "record-without-the-shard": (
        _files(lambda files: {k: v for k, v in files.items() if k != SHARD}),
        f"{SHARD} is not in integrity.json",
    ),
    "info-truncated": (_cut(INFO), "titanrush.json has "),
    "info-garbage-recorded": (_garbage(INFO, record=True), "titanrush.json is not valid JSON"),
    "info-a-list-recorded": (
        _edit(INFO, lambda info: [info], record=True),
        "titanrush.json is not a JSON object (it holds a list)",
    ),
    "info-step-a-string-recorded": (
        _edit(INFO, lambda info: {**info, "step": "four"}, record=True),
        'titanrush.json has step "four" (a string), not a whole number',
    ),
    "info-model-only-a-string-recorded": (
        _edit(INFO, lambda info: {**info, "model_only": "no"}, record=True),
        'titanrush.json has model_only "no" (a string), not true or false',
    ),
    "info-dim-a-string-recorded": (
        _edit(INFO, lambda info: {**info, "model_args": {**info["model_args"], "dim": "256"}}, record=True),
        'titanrush.json has model_args.dim "256" (a string), not a whole number',
    ),
    "metadata-truncated": (_cut(".metadata"), ".metadata has "),
    "metadata-garbage": (_garbage(".metadata", same_size=True), ".metadata bytes 0-"),
    "metadata-truncated-unrecorded": (_unrecorded(_cut(".metadata")), ".metadata cannot be read (Unpickling"),
    "metadata-empty-unrecorded": (_unrecorded(_cut(".metadata", 0)), ".metadata cannot be read (EOFError"),
    "shard-truncated": (_cut(SHARD), f"{SHARD} has "),
    "shard-empty": (_cut(SHARD, 0), f"{SHARD} has 0 bytes, the record says "),
    "shard-truncated-unrecorded": (_unrecorded(_cut(SHARD)), ".metadata places data up to byte"),
    "shard-empty-unrecorded": (_unrecorded(_cut(SHARD, 0)), f"{SHARD} has 0 bytes, .metadata places data"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_files_are_refused_as_corrupt_in_one_line_touching_nothing(
    saved, tmp_path, case, capsys, no_tensor_read
):
    """Each small file edited by hand (cut short, not JSON, JSON of another shape) and each data file cut
    short: a resume and `--check` refuse the checkpoint with exit status 2 and one line that names the
    file and what to do, before any tensor is read and without changing a file of the run."""
    run = shutil.copytree(saved, tmp_path / "src")
    damage, said = DAMAGE[case]
    step = run / "checkpoint" / "step-4"
    damage(step)
    before = _files_of(run)
    capsys.readouterr()  # (what set-up logged, where an earlier test set the console up)
    for check in ([], ["--check"]):
        assert main(run_args(tmp_path, "src", 8, *CKPT, *check)) == 2, check
        err = capsys.readouterr().err.strip()
        assert_one_line(err)
        assert err.startswith(f"titanrush: config error: checkpoint {step} is corrupt: "), err
        assert said in err, err
        advice = "resume from step-2, the newest earlier sound checkpoint, by moving this one aside"
        assert err.endswith(f"; {advice} (mv {step} {step}.bad) or deleting it"), err
        assert _files_of(run) == before  # nothing moved, deleted or rewritten in the run folder


def test_an_earlier_checkpoint_damaged_too_is_not_recommended(saved, tmp_path, capsys, no_tensor_read):
    """Step 4 and step 2 both cut short (one damaged disk): the refusal of step 4 named step 2 as the one
    to resume from, whose own refusal then said there was none; now it says so at once, with both moves."""
    run = shutil.copytree(saved, tmp_path / "src")
    ck = run / "checkpoint"
    for step in ("step-2", "step-4"):
        _cut(SHARD)(ck / step)
    before = _files_of(run)
    capsys.readouterr()
    assert main(run_args(tmp_path, "src", 8, *CKPT)) == 2
    err = capsys.readouterr().err.strip()
    assert_one_line(err)
    assert err.startswith(f"titanrush: config error: checkpoint {ck / 'step-4'} is corrupt: "), err
    moves = f"mv {ck / 'step-4'} {ck / 'step-4'}.bad; mv {ck / 'step-2'} {ck / 'step-2'}.bad"
    assert err.endswith(
        f"; no earlier sound checkpoint exists (step-2 is damaged too): move these aside ({moves}) to "
        "start over"
    ), err
    assert _files_of(run) == before
    for step in ("step-2", "step-4"):  # the advice works: the run starts over
        os.replace(ck / step, ck / f"{step}.bad")
    assert build(run_args(tmp_path, "src", 8, *CKPT)).step == 0


def _files_of(run: Path) -> dict[str, tuple[int, int]]:
    """snapshot(run) but the run's lock file, which each launch takes (and rewrites) and releases."""
    return {k: v for k, v in snapshot(run).items() if k != ".lock"}


# --------------------------------------------------------------------------------------------------
# Incompatible


def test_untied_checkpoint_into_a_tied_model_is_incompatible_before_any_tensor_loads(copy, no_tensor_read):
    ck = copy / "checkpoint" / "step-4"
    with pytest.raises(ConfigError) as e:
        build(
            run_args(
                copy.parent, "tied", 8, "--checkpoint.load_path", str(ck), "--model.tie_embeddings", "tied"
            )
        )
    msg = str(e.value)
    assert_one_line(msg)
    assert (
        f"checkpoint {ck} is incompatible with this run: model: tie_embeddings is false there, true here"
        in msg
    )
    assert "model.tie_embeddings = untied" in msg and "corrupt" not in msg
    assert not (copy.parent / "tied").exists()  # refused before the run folder is written


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            ["--training.seed", "7"],
            "data loader state was saved for training.seed = 42, this run has "
            "training.seed = 7: resuming the data position is impossible",
        ),
        (
            ["--training.local_batch_size", "3"],
            "data loader state was saved for dp=1 with local batch 2 "
            "after 8 windows, this run has dp=1 with local batch 3 (3 windows a micro-batch): 8 is not a "
            "multiple of 3",
        ),
    ],
    ids=["seed", "batch_layout"],
)
def test_healthy_checkpoint_under_other_settings_is_incompatible_not_corrupt(copy, change, expected):
    ck = copy / "checkpoint" / "step-4"
    with pytest.raises(ConfigError) as e:
        build(run_args(copy.parent, "other", 8, "--checkpoint.load_path", str(ck), *change))
    msg = str(e.value)
    assert_one_line(msg)
    assert msg.startswith(f"checkpoint {ck} is incompatible with this run: ") and expected in msg, msg
    assert "corrupt" not in msg
    assert msg.endswith("take only its weights into a new run: add --checkpoint.load_model_only")
    # What the message offers works: the weights alone load.
    trainer = build(
        run_args(
            copy.parent,
            "weights",
            8,
            "--checkpoint.load_path",
            str(ck),
            *change,
            "--checkpoint.load_model_only",
        )
    )
    assert trainer.step == 0
    trainer.close()


def test_missing_optimizer_entry_is_incompatible_and_names_the_optimizer_it_was_saved_with(copy):
    """A healthy checkpoint (its record matches) whose optimizer state lacks an entry this run needs, as one
    saved by another optimizer: named, with the optimizer it was saved with, never called corrupt."""
    ck = copy / "checkpoint" / "step-4"
    metadata = pickle.loads((ck / ".metadata").read_bytes())
    key = next(k for k in sorted(metadata.state_dict_metadata) if k.startswith("optimizer.state."))
    del metadata.state_dict_metadata[key]
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    info = json.loads((ck / "titanrush.json").read_text())
    (ck / "titanrush.json").write_text(json.dumps({**info, "optimizer": "adamw8bit"}))
    integrity.record_folder(ck)  # the edited files are what the record says: a healthy checkpoint
    with pytest.raises(ConfigError) as e:
        build(run_args(copy.parent, "other", 8, "--checkpoint.load_path", str(ck)))
    msg = str(e.value)
    assert_one_line(msg)
    assert f"is incompatible with this run: optimizer state: {key} is missing there" in msg
    assert msg.count("set optimizer.name = 'adamw8bit' (the optimizer it was saved with)") == 1, msg
    assert "corrupt" not in msg


def test_checkpoint_without_a_record_loads_unverified_with_a_warning(copy, said):
    """As saved before integrity records (or by `titanrush convert`): complete, loaded, said."""
    ck = copy / "checkpoint" / "step-4"
    (ck / integrity.RECORD_FILE).unlink()
    info = json.loads((ck / "titanrush.json").read_text())
    (ck / "titanrush.json").write_text(json.dumps({k: v for k, v in info.items() if k != "integrity"}))
    trainer = build(run_args(copy.parent, "src", 8, *CKPT))
    assert trainer.step == 4 and "its bytes are not verified" in said.find(f"{ck} has no integrity record")
    trainer.close()


def test_a_batch_layout_that_divides_the_data_position_resumes_it_exactly(copy):
    ck = copy / "checkpoint" / "step-4"  # 4 steps x 2 sequences = 8 windows read
    trainer = build(
        run_args(
            copy.parent, "wide", 8, "--checkpoint.load_path", str(ck), "--training.local_batch_size", "4"
        )
    )
    assert trainer.step == 4 and trainer.train_loader.state_dict()["windows"] == 8
    trainer.close()


# --------------------------------------------------------------------------------------------------
# Incomplete


@pytest.mark.parametrize("missing", [".metadata", "integrity.json", "__0_0.distcp"])
def test_incomplete_step_folder_is_moved_aside_and_the_run_resumes_from_the_newest_complete(
    copy, missing, said
):
    ck = copy / "checkpoint"
    (ck / "step-4" / missing).unlink()
    (ck / "step-3.tmp").mkdir()  # and a partial save of a run killed while writing it
    (ck / "step-3.tmp" / "__0_0.distcp").write_bytes(b"partial")
    trainer = build(run_args(copy.parent, "src", 4, *CKPT))
    assert trainer.step == 2
    assert not (ck / "step-3.tmp").exists() and said.find(f"removed {ck / 'step-3.tmp'}, a save that did not")
    warning = said.find("is incomplete")
    assert f"it lacks {missing}" in warning and "moved aside to step-4.incomplete-1" in warning
    assert (ck / "step-4.incomplete-1").is_dir() and not (ck / "step-4").exists()
    try:
        trainer.train()  # saves step 4 again: the folder in the way is gone
    finally:
        trainer.close()
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4", "step-4.incomplete-1"]


# --------------------------------------------------------------------------------------------------
# A model-only final save


def test_model_only_final_save_falls_back_to_the_newest_full_checkpoint(tmp_path, said):
    only = ["--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"]
    train(run_args(tmp_path, "run", 4, "--checkpoint.enable", "--checkpoint.interval", "3", *only))
    ck = tmp_path / "run" / "checkpoint"
    trainer = build(run_args(tmp_path, "run", 7, "--checkpoint.enable", "--checkpoint.interval", "3", *only))
    assert trainer.step == 3  # step-4 holds only weights
    assert "resuming the full state from step-3, the newest full checkpoint" in said.find("step-4 holds only")
    try:
        trainer.train()
    finally:
        trainer.close()
    assert sorted(p.name for p in ck.iterdir()) == ["step-3", "step-4", "step-6", "step-7"]


def test_model_only_save_in_the_way_of_a_full_one_is_kept_aside(tmp_path):
    only = ["--checkpoint.last_save_model_only"]
    train(run_args(tmp_path, "run", 4, *CKPT, *only))  # step-2 full, step-4 weights only
    train(run_args(tmp_path, "run", 6, *CKPT, *only))  # resumes at 2, saves step 4 in full
    ck = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4", "step-4.model-only-1", "step-6"]
    trainer = build(run_args(tmp_path, "run", 8, *CKPT))
    assert trainer.step == 4  # step 4 is a full checkpoint now
    trainer.close()


def test_a_dangling_link_or_a_file_in_a_saves_way_is_kept_aside(tmp_path):
    """A `step-N` that is no folder used to fail the save at step N, naming the folder as unwritable."""
    ck = tmp_path / "run" / "checkpoint"
    ck.mkdir(parents=True)
    (ck / "step-2").symlink_to(tmp_path / "gone" / "step-2")
    (ck / "step-4").write_text("not a checkpoint")
    train(run_args(tmp_path, "run", 4, *CKPT))
    assert sorted(p.name for p in ck.iterdir()) == [
        "step-2",
        "step-2.not-a-checkpoint-1",
        "step-4",
        "step-4.not-a-checkpoint-1",
    ]
    assert (ck / "step-2.not-a-checkpoint-1").is_symlink()
    assert (ck / "step-4.not-a-checkpoint-1").read_text() == "not a checkpoint"
    trainer = build(run_args(tmp_path, "run", 6, *CKPT))
    assert trainer.step == 4
    trainer.close()
    for n, target in enumerate(["again", "more"], start=1):  # a kept link to nothing is never replaced
        (ck / "step-9").symlink_to(tmp_path / "gone" / target)
        assert move_aside(ck / "step-9", "x").name == f"step-9.x-{n}"
    assert [os.readlink(ck / f"step-9.x-{n}") for n in (1, 2)] == [
        str(tmp_path / "gone" / t) for t in ("again", "more")
    ]


def test_only_model_only_checkpoints_say_exactly_what_works(tmp_path, capsys):
    only = ["--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.last_save_model_only"]
    train(run_args(tmp_path, "run", 2, *only))
    capsys.readouterr()  # (what the first run logged, where an earlier test set the console up)
    assert main(run_args(tmp_path, "run", 4, *only)) == 2
    err = capsys.readouterr().err.strip()
    assert_one_line(err)
    final = tmp_path / "run" / "checkpoint" / "step-2"
    fix = f"--job.name <new name> --checkpoint.load_path {final} --checkpoint.load_model_only"
    assert "holds only model-only checkpoints (step-2" in err and fix in err
    # The command it gives works.
    new = fix.replace("<new name>", "fresh").split()
    assert main(run_args(tmp_path, "run", 4, *only) + new) == 0
    assert (
        len([x for x in (tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x])
        == 4
    )


# --------------------------------------------------------------------------------------------------
# Saving: a full disk, an unwritable folder


@contextlib.contextmanager
def full_disk_for(monkeypatch, folder_name: str):
    """Writes of DCP's data files into `folder_name` go to /dev/full: the kernel's real ENOSPC, through
    torch's real write path (torch.save into a stream, DCP's writer threads, its failure gathering)."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if Path(path).parent.name == folder_name and str(path).endswith(".distcp"):
            with open("/dev/full", "wb") as stream:
                yield stream
        else:
            with real(self, path, mode) as stream:
                yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    yield


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_full_disk_during_a_save_stops_with_one_line_and_exit_1_leaving_earlier_checkpoints(
    copy, mode, monkeypatch, capsys
):
    ck = copy / "checkpoint"
    before = snapshot(ck)
    with full_disk_for(monkeypatch, "step-6.tmp"):
        status = main(run_args(copy.parent, "src", 8, *CKPT, "--checkpoint.async_mode", mode))
    assert status == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert_one_line(err)
    assert err.startswith(
        f"titanrush: error: checkpoint step-6 could not be written: the disk of {ck} is full"
    )
    assert "The partial step-6.tmp was removed; earlier checkpoints are untouched (newest: step-4)" in err
    assert snapshot(ck) == before  # no .tmp left, step-2 and step-4 as they were
    for step in (2, 4):
        record = integrity.read_record(ck / f"step-{step}")
        assert integrity.verify(ck / f"step-{step}", record) == []


def test_torch_write_failure_without_errno_on_a_full_disk_is_named_full(tmp_path, monkeypatch):
    # torch.save to a path on a full disk raises "[enforce fail at inline_container.cc:672] unexpected pos"
    # with no errno: the free space tells.
    from titanrush import files

    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662")
    monkeypatch.setattr(files, "free_bytes", lambda path: 0)
    assert files.is_disk_full(err, tmp_path)
    monkeypatch.setattr(files, "free_bytes", lambda path: 100 * 2**30)
    assert not files.is_disk_full(err, tmp_path)


def test_unwritable_checkpoint_folder_is_refused_at_start(tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder is needed")
    argv = run_args(tmp_path, "run", 4, *CKPT, "--checkpoint.folder", str(blocker / "checkpoints"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert_one_line(err)
    assert "checkpoint.folder: " in err and "so no checkpoint could be saved" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before any step


def _without_dac_override() -> list[str] | None:
    """A command prefix that runs a program bound by permission bits: none for a user other than root;
    for root, root without CAP_DAC_OVERRIDE (the capability that writes through them), which keeps its
    uid and so can still read this checkout and Python (a uid like nobody might not); None if no tool
    here drops it."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv"):  # util-linux
        return ["setpriv", "--bounding-set", "-dac_override", "--"]
    if shutil.which("capsh"):  # libcap
        return ["capsh", "--drop=cap_dac_override", "--", "-c", 'exec "$0" "$@"']
    return None


@pytest.mark.skipif(
    _without_dac_override() is None, reason="root, and neither setpriv nor capsh to drop CAP_DAC_OVERRIDE"
)
def test_read_only_checkpoint_folder_is_refused_at_start(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    argv = run_args(tmp_path, "run", 4, *CKPT, "--checkpoint.folder", str(folder))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [*_without_dac_override(), sys.executable, "-m", "titanrush.train", *argv]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        folder.chmod(0o700)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and err, res.stderr[-3000:]
    assert_one_line(err[-1])
    said = f"titanrush: config error: checkpoint.folder: {folder} cannot be written (Permission denied)"
    assert err[-1].startswith(said), err[-1]
    assert list(folder.iterdir()) == []  # not even the write probe left behind
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before any step


def _tmpfs_available() -> str:
    """'' where this user can mount a tmpfs in a mount namespace of its own, else why not."""
    if not shutil.which("unshare"):
        return "no unshare command"
    mount = ["unshare", "--mount", "--map-root-user", "sh", "-c", "mount -t tmpfs -o size=1m x /mnt"]
    probe = subprocess.run(mount, capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.strip()[:100]}"


@pytest.mark.skipif(bool(_tmpfs_available()), reason=_tmpfs_available() or "")
def test_a_real_full_disk_warns_at_start_and_stops_the_save_cleanly(tmp_path):
    """A 10 MB tmpfs holds one checkpoint of the one-layer model (about 7 MB), not two."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    argv = run_args(tmp_path, "run", 6, *CKPT, "--checkpoint.folder", str(mnt / "ck"))
    train_cmd = " ".join([sys.executable, "-m", "titanrush.train", *argv])
    script = (
        f"mount -t tmpfs -o size=10m tmpfs {mnt} && {train_cmd} --training.steps 2; "  # step-2 fits
        f"{train_cmd}; echo status=$?; ls {mnt}/ck"  # resumes at 2: warned at start, step 4 does not fit
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout + res.stderr
    assert "the next save (step 3) will not fit" in out, out[-3000:]
    assert "status=1" in out, out[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("titanrush: error:"))
    assert f"checkpoint step-4 could not be written: the disk of {mnt / 'ck'} is full" in line
    assert res.stdout.split("status=1")[1].split() == ["step-2"]  # no step-4.tmp left


# --------------------------------------------------------------------------------------------------
# Saves and their records


@pytest.mark.parametrize("mode", ["disabled", "async", "async_pinned"])
def test_every_save_mode_writes_an_integrity_record_of_every_file(tmp_path, mode):
    train(run_args(tmp_path, "run", 2, *CKPT, "--checkpoint.async_mode", mode))
    step = tmp_path / "run" / "checkpoint" / "step-2"
    record = integrity.read_record(step)
    files = sorted(p.name for p in step.iterdir() if p.name != integrity.RECORD_FILE)
    assert sorted(record["files"]) == files and ".metadata" in files and "titanrush.json" in files
    assert integrity.verify(step, record) == []
    assert all(record["files"][f]["size"] == (step / f).stat().st_size for f in files)


# --------------------------------------------------------------------------------------------------
# Resuming


def test_training_steps_at_the_resumed_step_says_so_and_exits_0(copy, said):
    before = snapshot(copy / "checkpoint")
    assert main(run_args(copy.parent, "src", 4, *CKPT)) == 0
    assert said.find("the checkpoint at step 4 already reaches training.steps = 4: nothing to train")
    assert snapshot(copy / "checkpoint") == before


def test_training_steps_below_the_resumed_step_is_refused_with_exit_2(copy, capsys):
    assert main(run_args(copy.parent, "src", 3, *CKPT)) == 2
    err = capsys.readouterr().err.strip()
    assert_one_line(err)
    ck = copy / "checkpoint"
    assert (
        f"the checkpoint at step 4 ({ck}/step-4) is past training.steps = 3: raise training.steps above 4"
        in err
    )
    new_run = f"--job.name <new name> --checkpoint.load_path {ck}/step-2"
    assert f"to stop at step-2 instead, start a new run from it: {new_run}" in err


def test_changed_learning_rate_and_weight_decay_on_resume_are_applied_and_said(copy, said):
    lr, wd = 1e-3, 0.05  # the saved run: optimizer.lr 3e-3, weight_decay 0.1 (the defaults)
    trainer = build(
        run_args(copy.parent, "src", 8, *CKPT, "--optimizer.lr", str(lr), "--optimizer.weight_decay", str(wd))
    )
    line = said.find("resumed with this run's settings")
    assert "optimizer.lr 0.003 -> 0.001" in line and "optimizer.weight_decay 0.1 -> 0.05" in line
    group = trainer.optimizer.param_groups[0]
    factor = lr_factor(5, warmup_steps=2, total_steps=8, decay="linear", decay_ratio=0.2, min_lr_factor=0.1)
    assert group["lr"] == pytest.approx(lr * factor) and group["weight_decay"] == wd
    assert trainer.scheduler.base_lrs == [lr]
    try:
        trainer.train(stop_at=5)
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if "loss" in r][-1]["step"] == 5
    assert [r for r in rows if "loss" in r][-1]["lr"] == pytest.approx(lr * factor)  # step 5 ran at it


RNG_WORKER = r"""
import os, sys, torch, torch.distributed as dist
from pathlib import Path
from titanrush.checkpoint.manager import CheckpointManager

class Plain:  # a schedule / data loader stand-in: plain state
    def state_dict(self): return {"value": 1}
    def load_state_dict(self, state): pass

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def manager():
    return CheckpointManager(Path(sys.argv[1]), enable=True, interval=1, keep_latest_k=0,
        async_mode="disabled", model_parts=[model], optimizers=[opt], lr_scheduler=Plain(),
        dataloader=Plain(), info={}, rank=rank)
torch.manual_seed(100 + rank)  # each rank's generator in its own state, as dropout would leave it
torch.rand(rank + 1)
manager().save(1)
expected = torch.rand(8)  # what each rank draws next after the save
torch.manual_seed(0)  # a relaunch: every rank seeded alike
assert manager().resume(steps=2) == 1
got = torch.rand(8)
out = [None, None]
dist.all_gather_object(out, (torch.equal(got, expected), got.tolist()))
if rank == 0:
    print("RESULT", out[0][0], out[1][0], out[0][1] != out[1][1])
dist.destroy_process_group()
"""


def test_each_rank_gets_its_own_rng_state_back(tmp_path):
    script = tmp_path / "rng_worker.py"
    script.write_text(RNG_WORKER)
    res = spawn([str(script), str(tmp_path / "ck")], 2, timeout=300)  # (two gloo ranks, no launcher)
    assert res.returncode == 0, res.stdout[-3000:]
    result = next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))
    assert result == "RESULT True True True", result  # each rank its own state back; the two differ
