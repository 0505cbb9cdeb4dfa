"""Data that changes underfoot (issue #48), each case reproduced on CPU against the real trainer.

A checkpoint records a fingerprint of the train data (each file's size and sampled CRC-32s). A resume on
data that changed at the same path (a shard overwritten with other bytes of the same length, shards
re-prepared from fewer documents, a `files` corpus edited) stops with exit status 2 and one line naming
the change, in the run and under `--check`; `--data.allow_changed` resumes knowingly. Unchanged data, and
data only touched (a new modification time), resumes; so does a checkpoint saved before fingerprints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from faults import CKPT, assert_one_line, build, run_args, snapshot, train

from titanrush.checkpoint import integrity
from titanrush.data.prepare import main as prepare
from titanrush.train import main

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "seven", "owls"]


@pytest.fixture(autouse=True)
def fresh_log_handler() -> None:
    """`main` sets up titanrush's log handler once per process; each test's own is made anew."""
    logging.getLogger("titanrush").handlers.clear()


@pytest.fixture
def said():
    """titanrush's log lines (INFO and up) during the test."""
    logger, lines = logging.getLogger("titanrush"), []
    handler, level = logging.Handler(logging.INFO), logger.level
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _documents(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) for _ in range(n)]


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(n)))
    return path


def _prepare(docs: Path, out: Path, *extra: str) -> None:
    assert prepare(["--input", str(docs), "--output", str(out), "--workers", "1", *extra]) == 0


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs of the one-layer model, 8 steps cut off after step 4 (checkpoints at 2 and 4): one on shards
    prepared from 150 documents, one on a `files` corpus of 150 .txt documents; each with its data."""
    root = tmp_path_factory.mktemp("data_changed")
    _prepare(_jsonl(root / "docs.jsonl", 150), root / "shards")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(_documents(150)):
        (corpus / f"doc_{i:03d}.txt").write_text(text)
    for kind, path in (("shards", root / "shards"), ("files", corpus)):
        data = ["--data.dataset", kind, "--data.path", str(path)]
        train(run_args(root / kind, "src", 8, *CKPT, *data), stop_at=4)
    return {"root": root, "shards": root / "shards", "files": corpus}


@pytest.fixture(params=["shards", "files"])
def case(request, sources: dict[str, Path], tmp_path: Path) -> tuple[str, Path, list[str]]:
    """(dataset kind, this test's copy of its data, the args that continue its run's copy)."""
    kind = request.param
    data = Path(shutil.copytree(sources[kind], tmp_path / kind))
    shutil.copytree(sources["root"] / kind / "src", tmp_path / "src")
    args = run_args(tmp_path, "src", 8, *CKPT, "--data.dataset", kind, "--data.path", str(data))
    return kind, data, args


def _error(capsys) -> str:
    """The one `titanrush: config error: ...` line of a refused run (the log comes before it)."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("titanrush")]
    assert lines and "Traceback" not in err, err[-3000:]
    assert_one_line(lines[-1])
    return lines[-1]


def _change(kind: str, data: Path, how: str) -> str:
    """Change the data as the issue's cases do; the fragment the refusal must name."""
    if how == "same_length":  # other bytes, the same length (a shard of other valid tokens)
        target = data / ("train_00000.bin" if kind == "shards" else "doc_007.txt")
        raw = target.read_bytes()
        half = len(raw) // 4 * 2  # (whole uint16 tokens)
        target.write_bytes(raw[half:] + raw[:half])
        return f"{target.name} has other bytes at the same size (sampled blocks differ)"
    if kind == "shards":  # re-prepared from 100 of the 150 documents
        _prepare(_jsonl(data.parent / "fewer.jsonl", 100), data, "--overwrite")
        return "train_00000.bin has "
    for path in sorted(data.iterdir())[60:]:  # 150 documents edited down to 60
        path.unlink()
    return "90 files removed (doc_060.txt, doc_061.txt, doc_062.txt, ... 87 more)"


@pytest.mark.parametrize("how", ["same_length", "fewer_documents"])
@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_changed_data_is_refused_in_one_line_naming_the_change(case, how, check, capsys):
    kind, data, args = case
    fragment = _change(kind, data, how)
    ck = data.parent / "src" / "checkpoint" / "step-4"
    before = snapshot(ck.parent)
    assert main(args + (["--check"] if check else [])) == 2
    err = _error(capsys)
    assert err.startswith(f"titanrush: config error: checkpoint {ck} is incompatible with this run: "), err
    assert f"the train data changed since the save: {fragment}" in err, err
    assert "point data.path at the data it was saved with, or add --data.allow_changed" in err, err
    assert snapshot(ck.parent) == before


def test_allow_changed_resumes_on_the_changed_data_and_says_so(case, said):
    kind, data, args = case
    fragment = _change(kind, data, "fewer_documents")
    trainer = build(args + ["--data.allow_changed"])
    try:
        assert trainer.step == 4
        warning = next(line for line in said if "on changed data (data.allow_changed)" in line)
        assert fragment in warning, warning
        trainer.train()
    finally:
        trainer.close()
    # The checkpoints saved since record the data as it is now: the next resume takes it unasked.
    assert main(run_args(data.parent, "src", 10, *CKPT, *args[-4:])) == 0


def test_unchanged_and_only_touched_data_resumes(case, said):
    kind, data, args = case
    later = (data / ("train_00000.bin" if kind == "shards" else "doc_000.txt")).stat().st_mtime + 3600
    for path in data.iterdir():  # a new modification time, the same bytes (`touch`, a copy)
        os.utime(path, (later, later))
    trainer = build(args)
    try:
        assert trainer.step == 4
        assert any("changed only the modification time" in line for line in said), said
    finally:
        trainer.close()


def test_an_unchanged_resume_and_check_pass(case, capsys):
    _, _, args = case
    assert main(args + ["--check"]) == 0
    assert main(args) == 0


def test_a_checkpoint_saved_before_fingerprints_resumes_with_one_line(case, said):
    kind, data, args = case
    ck = data.parent / "src" / "checkpoint" / "step-4"
    info = json.loads((ck / "titanrush.json").read_text())
    assert info["data"]["dataset"] == kind and info["data"]["files"]
    (ck / "titanrush.json").write_text(json.dumps({k: v for k, v in info.items() if k != "data"}))
    integrity.record_folder(ck)  # (as such a checkpoint was saved: its record matches)
    _change(kind, data, "fewer_documents")  # not comparable: resumed as before fingerprints
    trainer = build(args)
    try:
        assert trainer.step == 4
        assert any("records no data fingerprint" in line for line in said), said
    finally:
        trainer.close()
