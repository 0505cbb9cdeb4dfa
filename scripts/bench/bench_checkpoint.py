"""Checkpoint save and load times: save under the config's mesh, resume under another (checkpoint_8b.md).

On the GPU machine, from the repo root: python scripts/bench/bench_checkpoint.py --config
train_configs/llama8b_fsdp.toml --ngpu 4 --folder /dev/shm/ckbench --out DIR [--modes disabled,async_pinned]
[--resume-overrides "--parallelism.tp 2"] [--keep] [--dry-run] [overrides ...]. Per mode
(`checkpoint.async_mode`), 3 steps with a full checkpoint at step 2 (step 3 runs while an async save is in
flight): the time training was blocked (`ckpt_blocking_s`), until the checkpoint was complete
(`ckpt_save_s`), and in it rank 0's checksums for the integrity record (`ckpt_integrity_s`). Then a run
loads the last good checkpoint under `--resume-overrides` and trains on: `ckpt_load_s`, its integrity check
(`ckpt_verify_s`), whether it went on at step 3. Table: stdout and DIR/results.md (results.jsonl: each
run's command). Exit status 1 if a run is not ok.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from side_by_side import environment  # noqa: E402

from titanrush.tools.rush_runner import detect_oom, parse_with_overrides, read_metrics, run_child  # noqa: E402

SAVE_STEP = 2  # the measured save; the run has one more step


def launch(name: str, args: list[str], a: argparse.Namespace) -> tuple[dict, list[dict]]:
    """`NGPU=N ./run_train.sh ARGS` with its log in OUT; (row with status and command, metrics rows)."""
    args = [*args, "--metrics.log_freq", "1", "--job.dump_folder", str(a.out / "runs"), "--job.name", name]
    row = {"name": name, "command": f"NGPU={a.ngpu} ./run_train.sh {shlex.join(args)}"}
    print(f"[bench] {row['command']}", flush=True)
    shutil.rmtree(a.out / "runs" / name, ignore_errors=True)
    env = {**os.environ, "NGPU": str(a.ngpu), "PYTHONUNBUFFERED": "1"}
    log = a.out / f"{name}.log"
    rc, timed_out = run_child([str(ROOT / "run_train.sh"), *args], env, log, a.timeout_per_run)
    oom = rc and detect_oom(log.read_text(errors="replace"))
    row["status"] = "timeout" if timed_out else "ok" if rc == 0 else "OOM" if oom else f"failed ({rc})"
    return row, read_metrics(a.out / "runs" / name / "metrics.jsonl")


def save_args(mode: str, a: argparse.Namespace) -> list[str]:
    """3 steps, a full checkpoint at step 2 in this mode, a model-only bf16 one at step 3."""
    return [
        "--config",
        a.config,
        *a.extra,
        "--training.steps",
        str(SAVE_STEP + 1),
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(SAVE_STEP),
        "--checkpoint.async_mode",
        mode,
        "--checkpoint.folder",
        str(a.folder / f"save_{mode}"),
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
    ]


def resume_args(source: Path, a: argparse.Namespace) -> list[str]:
    """The checkpoint at `source` under the resume's mesh, resume_steps more steps, no saves."""
    return [
        "--config",
        a.config,
        *a.extra,
        *shlex.split(a.resume_overrides),
        "--training.steps",
        str(SAVE_STEP + a.resume_steps),
        "--no-checkpoint.enable",
        "--checkpoint.load_path",
        str(source),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--ngpu", type=int, required=True)
    ap.add_argument("--folder", required=True, type=Path, help="where checkpoints go (e.g. /dev/shm/ckbench)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--modes", default="disabled,async_pinned", help="disabled, async, async_pinned")
    ap.add_argument("--resume-overrides", default="--parallelism.tp 2", help="the resume's mesh")
    ap.add_argument("--resume-steps", type=int, default=2, help="steps after the load (0: no resume run)")
    ap.add_argument("--timeout-per-run", type=float, default=240)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--dry-run", action="store_true", help="print the runs' arguments and stop")
    a, a.extra = parse_with_overrides(ap, sys.argv[1:])
    a.folder, a.out = a.folder.resolve(), a.out.resolve()
    modes = a.modes.split(",")
    if a.dry_run:
        for mode in modes:
            print(shlex.join(save_args(mode, a)))
        if a.resume_steps > 0:
            print(shlex.join(resume_args(a.folder / f"save_{modes[-1]}" / f"step-{SAVE_STEP}", a)))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    rows, source = [], None
    for mode in modes:
        shutil.rmtree(a.folder / f"save_{mode}", ignore_errors=True)  # else the run would resume from it
        row, metrics = launch(f"save_{mode}", save_args(mode, a), a)
        rec = next((r for r in metrics if r["step"] == SAVE_STEP and r.get("ckpt_mode") == mode), None)
        ckpt = a.folder / f"save_{mode}" / f"step-{SAVE_STEP}"
        if rec is not None and ckpt.is_dir():
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30
            row.update(
                mode=mode,
                blocking_s=rec["ckpt_blocking_s"],
                save_s=rec["ckpt_save_s"],
                size_gib=size,
                record_s=rec.get("ckpt_integrity_s"),
            )
            source = ckpt
        elif row["status"] == "ok":
            row["status"] = f"no checkpoint of step {SAVE_STEP} logged"
        rows.append({"mode": mode, **row})
    if source is not None and a.resume_steps > 0:
        row, metrics = launch("resume", resume_args(source, a), a)
        load = next((r for r in metrics if "ckpt_load_s" in r), {})
        steps = [r["step"] for r in metrics if "loss" in r]
        if row["status"] == "ok" and steps[:1] != [SAVE_STEP + 1]:
            row["status"] = f"resumed at steps {steps}, expected {SAVE_STEP + 1}.."
        rows.append(
            {
                "mode": f"resume from {source.parent.name}",
                "load_s": load.get("ckpt_load_s"),
                "verify_s": load.get("ckpt_verify_s"),
                **row,
            }
        )
    if not a.keep:
        for mode in modes:
            shutil.rmtree(a.folder / f"save_{mode}", ignore_errors=True)
    env = environment(None)

    def f(row: dict, key: str) -> str:
        return "-" if row.get(key) is None else f"{row[key]:.2f}"

    for r in rows:  # the integrity record's share: checksums written inside the save, checked inside the load
        if r.get("record_s") is not None and r.get("save_s"):
            r["record_pct"] = 100 * r["record_s"] / r["save_s"]
    lines = [
        "| mode | checkpoint GiB | training blocked s | save complete s | of it record s | record % "
        "| load s | of it verify s | status |",
        "|---|" + "---:|" * 7 + "---|",
    ]
    keys = ("size_gib", "blocking_s", "save_s", "record_s", "record_pct", "load_s", "verify_s")
    lines += ["| " + " | ".join([r["mode"], *(f(r, k) for k in keys), r["status"]]) + " |" for r in rows]
    resumed = f"resumed with {a.resume_overrides}" if a.resume_steps > 0 else "no resume"
    header = (
        f"{env['date']}, {a.ngpu} x {env['device']}, torch {env['torch']}, commit {env['commit']}; "
        f"{shlex.join([a.config, *a.extra])}; {resumed}"
    )
    commands = "\n".join(f"- {r['name']}: `{r['command']}`" for r in rows)
    (a.out / "results.md").write_text(f"{header}\n\n" + "\n".join(lines) + f"\n\nCommands:\n\n{commands}\n")
    with open(a.out / "results.jsonl", "w") as fh:
        fh.writelines(json.dumps({**r, "env": env}) + "\n" for r in rows)
    print(header, *lines, sep="\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
