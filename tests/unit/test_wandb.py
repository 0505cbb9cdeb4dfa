"""Weights & Biases beside TensorBoard (metrics.wandb): an offline run under the run folder that holds
TensorBoard's scalars at TensorBoard's steps; never a prompt; a clear error without the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titanrush import config
from titanrush.config import ConfigError
from titanrush.run import validate
from titanrush.run.wandb_sink import choose_mode, has_credentials

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without W&B credentials or mode (a machine nobody logged in on), W&B's own
    folders in tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return {
        **env,
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        **extra,
    }


def _train(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    args = [
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "wb",
        "--training.steps",
        "4",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.wandb",
        "true",
        *extra,
    ]
    return subprocess.run(
        [sys.executable, "-m", "titanrush.train", *args], capture_output=True, text=True, env=env, timeout=600
    )


def _history(run_file: Path, env: dict[str, str]) -> list[dict]:
    """The rows the W&B run logged, read back from its .wandb file by `wandb leet inspect`."""
    res = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    records = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


def _tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_offline_run_under_the_run_folder_logs_what_tensorboard_logs(tmp_path):
    """Nobody logged in and no WANDB_MODE: the run logs offline (no prompt, no network) into
    <run folder>/wandb/, every TensorBoard scalar at its step, validation and checkpoint rows included
    (an async save's row is logged after later steps' rows), and its summary ends at metrics.jsonl's
    last loss."""
    pytest.importorskip("wandb")
    env = _env(tmp_path)
    res = _train(
        tmp_path,
        env,
        "--validation.freq",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "wb"
    (offline,) = (run_dir / "wandb").glob("offline-run-*")  # one attempt, one W&B run, offline
    (run_file,) = offline.glob("run-*.wandb")
    assert f"Weights & Biases: run wb, offline in {offline}" in res.stdout
    assert (
        f"  W&B          offline in {offline}; `wandb sync {offline}` uploads it" in res.stdout
    )  # (summary)

    history = _history(run_file, env)
    logged: dict[str, list[tuple[int, float]]] = {}
    for item in history:
        for tag, value in item.items():
            if not tag.startswith("_") and tag != "step":
                logged.setdefault(tag, []).append((item["step"], value))
    tb = _tensorboard(run_dir / "tb" / "attempt-1")
    assert {"loss", "validation/loss", "ckpt_save_s"} <= set(tb)
    assert set(logged) == set(tb)
    for tag, points in tb.items():  # (TensorBoard keeps float32)
        assert [s for s, _ in logged[tag]] == [s for s, _ in points], tag
        assert [v for _, v in logged[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_loss = [r["loss"] for r in rows if "loss" in r][-1]
    res = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(run_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    summary = json.loads(res.stdout)
    assert summary["state"] == "finished" and summary["name"] == "wb"
    assert summary["summary"]["loss"] == pytest.approx(last_loss, rel=1e-12)
    assert summary["config"]["training"]["steps"] == 4  # the resolved config, as config.toml holds it


def test_without_the_package_the_run_is_refused_naming_pip_install(tmp_path):
    """`import wandb` failing (a shim ahead on PYTHONPATH): one config error line, exit status 2, before
    anything is built; a broken install says its import error."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "wandb.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env["PYTHONPATH"]])
    res = _train(tmp_path, env, "--check")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        "titanrush: config error: metrics.wandb = true needs the wandb package (not installed): pip install "
        "wandb (or pip install -e '.[wandb]' in the checkout); or set metrics.wandb = false"
    ]
    assert not (tmp_path / "wb").exists()


def test_import_problem_names_a_broken_install(monkeypatch, tmp_path):
    (tmp_path / "broken_pkg.py").write_text("from google.protobuf import nothing_here  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert validate.import_problem("no_such_module_titanrush") == "not installed"
    assert validate.import_problem("broken_pkg").startswith("its import fails: ImportError: cannot import")
    assert validate.import_problem("json") == ""


def test_mode_is_offline_unless_credentials_or_wandb_mode(tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    nobody = {"NETRC": str(tmp_path / "none")}
    assert choose_mode(nobody) == "offline"
    assert choose_mode({**nobody, "WANDB_MODE": "disabled"}) is None  # wandb reads it itself
    assert choose_mode({**nobody, "WANDB_API_KEY": "x" * 40}) == "online"
    assert choose_mode({"NETRC": str(netrc)}) == "online"
    netrc.write_text("machine api.forge.coreweave.com\n  login user\n  password " + "k" * 40 + "\n")
    assert choose_mode({"NETRC": str(netrc)}) == "online"  # (wandb 0.31's default host)
    assert not has_credentials({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"})
    netrc.write_text("machine wandb.example.com\n  login user\n  password " + "k" * 40 + "\n")
    assert has_credentials({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"})
    netrc.write_text("machine\n")  # unreadable: as no credentials
    assert choose_mode({"NETRC": str(netrc)}) == "offline"


@pytest.mark.parametrize("project", ["", "team/project", "a" * 129, "what?"])
def test_a_project_name_wandb_refuses_is_a_config_error(project):
    cfg = config.load(None, ["--metrics.wandb", "true", "--metrics.wandb_project", project])
    with pytest.raises(ConfigError, match=r"^metrics.wandb_project = .*: a W&B project name has 1 to 128"):
        validate.check_values(cfg)
    cfg = config.load(None, ["--metrics.wandb_project", project])  # (not checked when not used)
    validate.check_values(cfg)


def test_a_wandb_that_does_not_start_leaves_no_run_folder(tmp_path):
    """W&B starts once the run is accepted, after its folder is written: its refusal (online without an
    API key) left config.toml, metrics.jsonl and tb/ behind, and a retry with job.overwrite = false was
    then refused for a folder that exists."""
    res = _train(tmp_path, _env(tmp_path, WANDB_MODE="online"), "--job.overwrite", "false")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "titanrush: config error: Weights & Biases did not start" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "wb").exists()
    retry = _train(tmp_path, _env(tmp_path), "--job.overwrite", "false", "--metrics.wandb", "false")
    assert retry.returncode == 0, retry.stderr[-2000:]
