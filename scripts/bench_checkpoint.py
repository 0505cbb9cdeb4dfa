"""Checkpoint save and load times: save under the config's mesh, resume under another, one table.

Usage:
  python scripts/bench_checkpoint.py --config train_configs/llama8b_fsdp.toml --ngpu 4 \
      --folder /dev/shm/ckbench --out DIR [--modes disabled,async_pinned] \
      [--resume-overrides "--parallelism.tp 2"] [--time-limit 540] [--keep] [--dry-run] [overrides ...]

1. One run per `--modes` entry, under the config's mesh (FSDP over all GPUs for the FSDP configs):
   3 steps, a full checkpoint (model, optimizer, ...) at step 2 with `checkpoint.async_mode` = the mode,
   so that step 3 runs while an async save is in flight (async_pinned's staging overlaps it and the
   optimizer step waits for it; that wait is blocking time). The trainer logs, in metrics.jsonl, the time
   training was blocked (`ckpt_blocking_s`) and the time until the checkpoint was complete and renamed
   (`ckpt_save_s`). The last step's save is a small model-only bf16 export, not measured here (the
   trainer always saves at the last step; a model-only one keeps that cheap).
2. One run that loads the newest of those checkpoints under the mesh of `--resume-overrides`
   (`checkpoint.load_path`, checkpointing otherwise off) and trains `--resume-steps` more steps: its
   `ckpt_load_s` (read, reshard, set; until every rank is done), and a check that it went on at step 3
   with finite losses.
3. The table (mode, checkpoint GiB, blocking s, save s, load s, resumed mesh, status) to stdout,
   DIR/results.md and DIR/results.jsonl (a row per run, with its exact command); each run's log is
   DIR/<run>.log and its metrics DIR/runs/<run>/.

Why the default is two save runs (disabled, async_pinned), not three: `checkpoint.async_mode` is fixed
for a run (it decides the process group and the stager the checkpointer builds), so each mode costs a
launch, and an 8B launch costs about a minute (start, compile, three steps, a 90 GiB save). Disabled is
the baseline and async_pinned the mode to use; plain async (staging into pageable memory inside the
save call) sits between them and costs one more run: add it with `--modes disabled,async,async_pinned`.

Failures are recorded and the script goes on (a save run that fails leaves the resume to the previous
good checkpoint). Every run gets at most the time left of `--time-limit`; a save run after the first
starts only if the time left covers two of the first one, so the resume keeps its turn. Run folders and
checkpoints (`--folder/<run>`) are emptied before each run; checkpoints are deleted at the end (and the
ones not needed for the resume as soon as measured) unless `--keep`; at most two full checkpoints exist at
once (the resume's candidate and the one being written), one if the folder has no room for two. Exit
status 1 if any run is not ok, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_runs import environment  # noqa: E402

from titanrush import config as cfgmod  # noqa: E402
from titanrush.tools.rush_runner import detect_oom, parse_with_overrides, read_metrics, run_child  # noqa: E402

SAVE_STEP = 2  # the measured save; the run has one more step
MODES = ("disabled", "async", "async_pinned")


def mesh_label(config: str, overrides: list[str], ngpu: int) -> str:
    """`FSDP4`, `FSDP2 x TP2`, ... for the config with these overrides on ngpu ranks."""
    p = cfgmod.load(config, overrides).parallelism
    others = p.dp_replicate * p.tp * p.pp * p.cp
    shard = ngpu // others if p.dp_shard == -1 else p.dp_shard
    dims = [("PP", p.pp), ("DP", p.dp_replicate), ("FSDP", shard), ("CP", p.cp), ("TP", p.tp)]
    return " x ".join(f"{name}{d}" for name, d in dims if d > 1) or "1 rank"


def launch(name: str, args: list[str], out: Path, ngpu: int, timeout: float) -> dict:
    """Run ./run_train.sh ARGS with NGPU=ngpu; kill its process group after `timeout` seconds."""
    command = f"NGPU={ngpu} ./run_train.sh " + shlex.join(args)
    print(f"[bench] {name}: {command}", flush=True)
    env = {**os.environ, "NGPU": str(ngpu), "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    log = out / f"{name}.log"
    rc, timed_out = run_child([str(ROOT / "run_train.sh"), *args], env, log, max(timeout, 1))
    row = {"name": name, "command": command, "wall_s": round(time.time() - t0, 1)}
    if timed_out:
        row["status"] = "timeout"
    elif rc != 0:
        text = log.read_text(errors="replace")
        row["status"] = "OOM" if detect_oom(text) else f"failed ({rc})"
    else:
        row["status"] = "ok"
    row["metrics"] = read_metrics(out / "runs" / name / "metrics.jsonl")  # a torn last line dropped
    return row


def gib(path: Path) -> float | None:
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def save_args(mode: str, a: argparse.Namespace, extra: list[str]) -> list[str]:
    """3 steps, a full checkpoint at step 2 in this mode, a model-only bf16 one at step 3."""
    return ["--config", a.config, *extra, "--training.steps", str(SAVE_STEP + 1), "--metrics.log_freq", "1",
            "--checkpoint.enable", "--checkpoint.interval", str(SAVE_STEP), "--checkpoint.async_mode", mode,
            "--checkpoint.folder", str(a.folder / f"save_{mode}"), "--checkpoint.keep_latest_k", "0",
            "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16",
            "--job.dump_folder", str(a.out / "runs"), "--job.name", f"save_{mode}"]  # fmt: skip


def resume_args(source: str, a: argparse.Namespace, extra: list[str]) -> list[str]:
    """The checkpoint at `source` under the resume's mesh, resume_steps more steps, no saves."""
    return ["--config", a.config, *extra, *a.resume, "--training.steps", str(SAVE_STEP + a.resume_steps),
            "--metrics.log_freq", "1", "--no-checkpoint.enable", "--checkpoint.load_path", source,
            "--job.dump_folder", str(a.out / "runs"), "--job.name", "resume"]  # fmt: skip


def save_run(mode: str, a: argparse.Namespace, extra: list[str], timeout: float) -> dict:
    name = f"save_{mode}"
    ckpt = a.folder / name
    shutil.rmtree(ckpt, ignore_errors=True)  # else the run would resume from it
    shutil.rmtree(a.out / "runs" / name, ignore_errors=True)
    row = {"kind": "save", "mode": mode, **launch(name, save_args(mode, a, extra), a.out, a.ngpu, timeout)}
    rows = row.pop("metrics")
    rec = next((r for r in rows if r["step"] == SAVE_STEP and r.get("ckpt_mode") == mode), None)
    if rec is not None:
        row.update(blocking_s=rec["ckpt_blocking_s"], save_s=rec["ckpt_save_s"])
        row["checkpoint"] = str(ckpt / f"step-{SAVE_STEP}")
        row["size_gib"] = gib(ckpt / f"step-{SAVE_STEP}")
    elif row["status"] == "ok":
        row["status"] = f"no ckpt_save_s row for step {SAVE_STEP}"
    export = next((r for r in rows if r.get("ckpt_mode") == "model_only"), None)
    row["export_s"] = export["ckpt_save_s"] if export else None
    row["losses"] = {r["step"]: r["loss"] for r in rows if "loss" in r}
    shutil.rmtree(ckpt / f"step-{SAVE_STEP + 1}", ignore_errors=True)  # the model-only export
    return row


def resume_run(source: str, a: argparse.Namespace, extra: list[str], timeout: float) -> dict:
    shutil.rmtree(a.out / "runs" / "resume", ignore_errors=True)
    last = SAVE_STEP + a.resume_steps
    args = resume_args(source, a, extra)
    row = {"kind": "resume", "source": source, **launch("resume", args, a.out, a.ngpu, timeout)}
    rows = row.pop("metrics")
    load = next((r for r in rows if "ckpt_load_s" in r), None)
    row["load_s"] = load["ckpt_load_s"] if load else None
    row["losses"] = {r["step"]: r["loss"] for r in rows if "loss" in r}
    steps, losses = list(row["losses"]), list(row["losses"].values())
    if row["status"] != "ok":
        return row
    if load is None or load["step"] != SAVE_STEP:
        row["status"] = f"no load of step {SAVE_STEP} logged"
    elif steps != list(range(SAVE_STEP + 1, last + 1)):
        row["status"] = f"steps {steps}, expected {SAVE_STEP + 1}..{last}"
    elif not all(math.isfinite(x) for x in losses):
        row["status"] = f"loss not finite: {losses}"
    else:
        row["status"] = f"ok (went on at step {steps[0]}, loss {losses[-1]:.3f})"
    return row


def table(saves: list[dict], resume: dict) -> str:
    def f(row: dict, key: str, fmt: str) -> str:
        return fmt.format(row[key]) if row.get(key) is not None else "-"

    lines = ["| mode | checkpoint GiB | blocking s | save s | load s | resumed mesh | status |",
             "|---|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for r in saves:
        resumed = r.get("checkpoint") is not None and resume.get("source") == r["checkpoint"]
        load = f(resume, "load_s", "{:.2f}") if resumed else "-"
        status = r["status"] + (f"; resume: {resume['status']}" if resumed else "")
        mesh = resume["mesh"] if resumed else "-"
        lines.append(f"| {r['mode']} | {f(r, 'size_gib', '{:.2f}')} | {f(r, 'blocking_s', '{:.2f}')} | "
                     f"{f(r, 'save_s', '{:.2f}')} | {load} | {mesh} | {status} |")  # fmt: skip
    if not any(r.get("checkpoint") is not None and resume.get("source") == r["checkpoint"] for r in saves):
        lines.append(f"| (resume) | - | - | - | - | {resume['mesh']} | {resume['status']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--ngpu", type=int, required=True)
    ap.add_argument("--folder", required=True, type=Path, help="where checkpoints go (e.g. /dev/shm/ckbench)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--modes", default="disabled,async_pinned", help="comma-separated async modes")
    ap.add_argument("--resume-overrides", default="--parallelism.tp 2", help="the resume's mesh")
    ap.add_argument("--resume-steps", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=540, help="seconds for everything")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--dry-run", action="store_true", help="print the runs' settings and stop")
    a, extra = parse_with_overrides(ap, sys.argv[1:] if argv is None else argv)
    deadline = time.time() + a.time_limit
    a.folder, a.out = a.folder.resolve(), a.out.resolve()
    a.resume = shlex.split(a.resume_overrides)
    modes = [m for m in a.modes.split(",") if m]
    try:
        if not modes or any(m not in MODES for m in modes):
            raise cfgmod.ConfigError(f"--modes {a.modes!r}: a comma-separated list of {', '.join(MODES)}")
        save_mesh = mesh_label(a.config, extra, a.ngpu)
        resume_mesh = mesh_label(a.config, [*extra, *a.resume], a.ngpu)
    except cfgmod.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[bench] saves under {save_mesh} ({', '.join(modes)}), resume under {resume_mesh}", flush=True)
    if a.dry_run:
        for mode in modes:
            print(f"NGPU={a.ngpu} ./run_train.sh " + shlex.join(save_args(mode, a, extra)))
        source = str(a.folder / f"save_{modes[-1]}" / f"step-{SAVE_STEP}")
        print(f"NGPU={a.ngpu} ./run_train.sh " + shlex.join(resume_args(source, a, extra)))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    saves: list[dict] = []
    source: dict | None = None
    for mode in modes:
        left = deadline - time.time()
        if left < 10 or (saves and left < 2 * saves[0].get("wall_s", 0)):
            saves.append({"kind": "save", "mode": mode, "name": f"save_{mode}", "status": "skipped (time)"})
            continue
        if source is not None and not a.keep and source["size_gib"]:
            a.folder.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(a.folder).free < 1.3 * source["size_gib"] * 2**30:
                print(f"[bench] too little room in {a.folder} for another checkpoint next to "
                      f"{source['checkpoint']}: deleting it first", flush=True)  # fmt: skip
                shutil.rmtree(Path(source["checkpoint"]).parent, ignore_errors=True)
                source = None
        row = save_run(mode, a, extra, left)
        row["mesh"] = save_mesh
        print(f"[bench] {row['name']}: {row['status']}", flush=True)
        saves.append(row)
        if row.get("checkpoint") and Path(row["checkpoint"]).is_dir():
            if source is not None and not a.keep:  # only the newest good one is needed from now on
                shutil.rmtree(Path(source["checkpoint"]).parent, ignore_errors=True)
            source = row
        elif not a.keep:
            shutil.rmtree(a.folder / row["name"], ignore_errors=True)
    resume: dict = {"kind": "resume", "name": "resume"}
    if source is None:
        resume["status"] = "skipped (no checkpoint)"
    elif deadline - time.time() < 10:
        resume.update(status="skipped (time)", source=source["checkpoint"])
    else:
        resume = resume_run(source["checkpoint"], a, extra, deadline - time.time())
        print(f"[bench] resume: {resume['status']}", flush=True)
    resume["mesh"] = resume_mesh
    if source is not None and not a.keep:
        shutil.rmtree(Path(source["checkpoint"]).parent, ignore_errors=True)

    env = environment()
    with open(a.out / "results.jsonl", "w") as fh:
        for row in [*saves, resume]:
            fh.write(json.dumps({**row, "env": env}) + "\n")
    config = shlex.join([a.config, *extra])
    header = (f"{env['date']}, {a.ngpu} x {env['device']}, torch {env['torch']}, commit {env['commit']}; "
              f"{config}; saved under {save_mesh} at step {SAVE_STEP} to {a.folder}, resumed under "
              f"{resume_mesh}")  # fmt: skip
    md = table(saves, resume)
    commands = "\n".join(f"- {r['name']}: `{r['command']}`" for r in [*saves, resume] if "command" in r)
    (a.out / "results.md").write_text(f"{header}\n\n{md}\n\nCommands:\n\n{commands}\n")
    print(header)
    print(md)
    print("\nCommands:\n" + commands)
    ok = all(r["status"] == "ok" for r in saves) and resume["status"].startswith("ok")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
