"""`plan.probe K` (`titanrush.run.probe`): the top K plans of the auto levers trained for a few steps each,
the fastest written into the run's config.toml, and the run itself untouched by the probe: its losses are
those of a run that names the chosen plan outright."""

from __future__ import annotations

import json
import re
from pathlib import Path

from titanrush import config, train
from titanrush.run import autoplan, memory_check, probe

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug.toml")
TINY = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "3",
    "--data.dataset",
    "synthetic",
    "--no-metrics.tensorboard",
    "--metrics.log_freq",
    "1",
]
AUTO = ["--activation_checkpoint.mode", "auto", "--training.loss", "auto"]


def losses(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_shortlist_is_the_chosen_plan_and_the_next_that_fit():
    over = [*AUTO, "--plan.gpu_mem_gib", "1.1"]
    choice = autoplan.resolve(config.load(DEBUG, over), 1, 1.1, "", machine=False)
    short = probe.shortlist(choice, 3)
    assert short[0] is choice.chosen and len(short) == 3 and len({id(c) for c in short}) == 3
    assert all(c.total <= choice.limit for c in short)
    assert [c.cost.extra_s for c in short] == sorted(c.cost.extra_s for c in short)
    cfg = probe.probe_config(choice, short[1], 1)
    assert cfg.training.steps == probe.WARMUP_STEPS + cfg.plan.probe_steps and not cfg.checkpoint.enable
    assert Path(cfg.job.dump_folder) == probe.folder(choice.given) and cfg.job.name == "1"
    explicit = memory_check.plan_run(config.load(DEBUG), 1, machine=False)
    assert probe.shortlist(explicit, 2) == []  # (no auto lever: nothing to probe)


def test_probe_measures_the_top_plans_keeps_the_fastest_and_leaves_the_run_as_it_was(tmp_path, capsys):
    """`--plan.probe 2` on the debug model (CPU, one process): two plans measured and tabled, the kept one
    in config.toml, the probe's folder gone; a run of the kept plan named outright has the same losses."""
    run = ["--config", DEBUG, *AUTO, *TINY, "--job.dump_folder", str(tmp_path), "--data.cache_dir"]
    run += [str(tmp_path / "cache")]
    assert train.main([*run, "--plan.probe", "2", "--plan.probe_steps", "1", "--job.name", "probed"]) == 0
    out = capsys.readouterr().out  # (progress and results: stdout)
    table = out[out.index("probe (plan.probe 2): 1 step each after 1 warm-up step") :].splitlines()
    rows = [line for line in table[2:4]]
    assert all(re.search(r"\d+$", r.strip()) for r in rows), rows  # (tokens/s each)
    assert sum(" * " in r for r in rows) == 1
    resolved = next(line for line in table if " resolved: " in line).split("resolved: ", 1)[1]
    written = config.read_toml(tmp_path / "probed" / "config.toml")
    for item in resolved.split(", "):
        key, value = item.split(" = ")
        section, name = key.split(".")
        assert json.dumps(written[section][name]) == value, key
    assert not probe.folder(config.load(DEBUG, run[2:] + ["--job.name", "probed"])).exists()
    assert '"auto"' not in (tmp_path / "probed" / "config.toml").read_text()
    # The same plan named outright (the written config.toml, no probe): the same losses, step for step.
    again = ["--config", str(tmp_path / "probed" / "config.toml"), "--plan.probe", "0", "--job.name", "plain"]
    assert train.main(again) == 0
    assert losses(tmp_path / "probed") == losses(tmp_path / "plain") and len(losses(tmp_path / "plain")) == 3
