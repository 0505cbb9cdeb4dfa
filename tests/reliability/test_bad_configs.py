"""Configs that were once accepted without a word (issue #48), given to the real entry point.

`./run_train.sh ... --check` is what a user runs before a long job; each case here either stops with one
line naming the key and the fix (exit 2) or is accepted with a warning that says what will happen. The
wording of each check is tested beside the code in tests/unit; here the point is that the launcher, the
loader and the validation together keep the promise, and that a refused config leaves no run folder.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`./run_train.sh ARGS --check` from tmp_path, the run folder inside it."""
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "out"), *args, "--check"]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)


REFUSED = [
    (["--training.steps", "2_0"], "training.steps must be an integer, got '2_0'"),
    (["--training.steps", "99999999999999999999"], "training.steps must be in [1,"),
    (["--training.seq_len", "1"], "training.seq_len must be >= 2"),
]


@pytest.mark.parametrize(("args", "said"), REFUSED, ids=["underscore", "huge", "seq_len_1"])
def test_a_bad_value_is_one_line_and_exit_2(tmp_path, args, said):
    done = check(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "out").exists()


def test_an_empty_config_file_is_refused(tmp_path):
    (tmp_path / "empty.toml").write_text("# nothing set yet\n")
    done = check(tmp_path, "--config", "empty.toml")
    assert done.returncode == 2, done.stderr
    assert "'empty.toml' is empty" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_warmup_as_long_as_the_run_and_a_key_given_twice_are_accepted_each_with_a_warning(tmp_path):
    done = check(
        tmp_path, "--training.steps", "5", "--training.steps", "10", "--lr_scheduler.warmup_steps", "10"
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert output.count("--training.steps is given twice") == 1 and "the last, 10, is used" in output
    assert "warmup_steps = 10 is not below training.steps = 10" in output
    assert output.count("never decays") == 1
