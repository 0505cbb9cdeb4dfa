"""Checkpoints on CPU: exact resume, pruning, crash safety, bad checkpoints, weights-only starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titanrush import config
from titanrush.config import ConfigError
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def args(tmp: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [
        "--job.dump_folder",
        str(tmp),
        "--job.name",
        name,
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--training.deterministic",
        "--lr_scheduler.warmup_steps",
        "2",
        *extra,
    ]


def train(argv: list[str], stop_at: int | None = None) -> None:
    cfg = config.load(None, argv)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        trainer.train(stop_at)
    finally:
        trainer.close()


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows_of(run_dir) if "loss" in r}


CKPT = ("--checkpoint.enable", "--checkpoint.interval", "3")


@pytest.mark.parametrize("mode", ["disabled", "async", "async_pinned"])
def test_resumed_run_repeats_the_uninterrupted_losses_bitwise(tmp_path, mode):
    train(args(tmp_path, "full", 6))
    train(
        args(tmp_path, "split", 6, *CKPT, "--checkpoint.async_mode", mode), stop_at=3
    )  # cut off after step 3
    train(args(tmp_path, "split", 6, *CKPT, "--checkpoint.async_mode", mode))  # resumes at step 3
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert [split[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]
    saved = sorted(p.name for p in (tmp_path / "split" / "checkpoint").iterdir())
    assert saved == ["step-3", "step-6"]


@pytest.mark.parametrize(
    "save_with",
    [
        ("--activation_checkpoint.mode", "full"),
        (
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective",
            "op",
            "--compile.enable",
        ),
    ],
    ids=["full_ac", "op_ac_compiled"],
)
def test_a_checkpoint_written_under_activation_checkpointing_loads_into_a_plain_run(tmp_path, save_with):
    """The recomputing wrapper (and compile's) leave the saved names alone: the checkpoint holds the
    model's own names, and a run without either resumes from it."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "2")
    train(args(tmp_path, "full", 4))
    train(args(tmp_path, "split", 4, *ckpt, *save_with), stop_at=2)
    reader = FileSystemReader(str(tmp_path / "split" / "checkpoint" / "step-2"))
    names = reader.read_metadata().state_dict_metadata
    assert "model.layers.0.attention.wq.weight" in names
    assert not [n for n in names if "_checkpoint_wrapped_module" in n or "_orig_mod" in n]
    train(args(tmp_path, "split", 4, *ckpt))  # resumes at step 2: no recomputation, no compile
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    # recomputation is exact; compiled kernels may round differently from eager ones (fp32 on CPU)
    assert [split[s] for s in (3, 4)] == pytest.approx([full[s] for s in (3, 4)], rel=1e-5)


@pytest.mark.parametrize("mode", ["disabled", "async", "async_pinned"])
def test_saves_and_resumes_log_their_timings(tmp_path, mode):
    train(args(tmp_path, "src", 3, *CKPT[:1], "--checkpoint.interval", "2", "--checkpoint.async_mode", mode))
    rows = rows_of(tmp_path / "src")
    saves = {r["step"]: r for r in rows if "ckpt_save_s" in r}
    assert sorted(saves) == [2, 3] and all("loss" not in r for r in saves.values())
    for r in saves.values():
        assert r["ckpt_mode"] == mode
        assert 0 < r["ckpt_blocking_s"] <= r["ckpt_save_s"] < 60, r
        assert 0 < r["ckpt_integrity_s"] < r["ckpt_save_s"], r  # the record is written inside the save
        if mode == "disabled":
            assert r["ckpt_blocking_s"] == r["ckpt_save_s"]
    ckpt = tmp_path / "src" / "checkpoint" / "step-2"
    train(args(tmp_path, "dst", 3, "--checkpoint.load_path", str(ckpt)))
    rows = rows_of(tmp_path / "dst")
    load = {
        "step": 2,
        "attempt": 1,
        "ckpt_load_s": rows[0]["ckpt_load_s"],
        "ckpt_load_path": str(ckpt),
        "ckpt_verify_s": rows[0]["ckpt_verify_s"],
    }
    assert rows[0] == load
    assert 0 < rows[0]["ckpt_verify_s"] < rows[0]["ckpt_load_s"] < 60
    assert [r["step"] for r in rows[1:]] == [3] and "loss" in rows[1]


def test_keep_latest_k_prunes_old_but_never_the_newest(tmp_path):
    train(
        args(
            tmp_path,
            "k",
            7,
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.keep_latest_k",
            "2",
        )
    )
    names = sorted(p.name for p in (tmp_path / "k" / "checkpoint").iterdir())
    assert names == ["step-6", "step-7"]


def test_incomplete_tmp_checkpoint_is_ignored(tmp_path):
    train(args(tmp_path, "t", 6, *CKPT), stop_at=3)
    ck = tmp_path / "t" / "checkpoint"
    (ck / "step-5.tmp").mkdir()  # what a run killed mid-save leaves
    cfg = config.load(None, args(tmp_path, "t", 6, *CKPT))
    trainer = Trainer(cfg, build_plan(cfg, 1))
    assert trainer.step == 3
    trainer.close()


def test_other_flavor_is_a_clear_error_and_nothing_is_touched(tmp_path):
    train(args(tmp_path, "a", 3, *CKPT))
    ck = tmp_path / "a" / "checkpoint" / "step-3"
    before = sorted((p.name, p.stat().st_size) for p in ck.iterdir())
    bad = args(tmp_path, "b", 3, "--checkpoint.load_path", str(ck), "--model.vocab_size", "9000")
    with pytest.raises(
        ConfigError, match=r"is incompatible with this run: model: vocab_size is 8192 there, 9000 here"
    ):
        cfg = config.load(None, bad)
        Trainer(cfg, build_plan(cfg, 1))
    assert sorted((p.name, p.stat().st_size) for p in ck.iterdir()) == before
    # Another model in the run's own folder (a new model, the same job.name): a folder of its own.
    with pytest.raises(ConfigError, match=r"9000 here\. To load it: .* folder of its own: --job\.name"):
        cfg = config.load(None, args(tmp_path, "a", 6, *CKPT, "--model.vocab_size", "9000"))
        Trainer(cfg, build_plan(cfg, 1))
    assert sorted((p.name, p.stat().st_size) for p in ck.iterdir()) == before


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    train(args(tmp_path, "c", 6, *CKPT), stop_at=3)
    ck = tmp_path / "c" / "checkpoint" / "step-3"
    data = next(ck.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])  # truncated
    with pytest.raises(
        ConfigError, match=rf"step-3 is corrupt: {data.name} has 1,000 bytes, the record says"
    ):
        cfg = config.load(None, args(tmp_path, "c", 6, *CKPT))
        Trainer(cfg, build_plan(cfg, 1))
    assert data.exists() and (ck / ".metadata").exists()
    (ck / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="is corrupt: .metadata has 7 bytes"):
        cfg = config.load(None, args(tmp_path, "d", 3, "--checkpoint.load_path", str(ck)))
        Trainer(cfg, build_plan(cfg, 1))


def test_missing_load_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        cfg = config.load(None, args(tmp_path, "m", 3, "--checkpoint.load_path", str(tmp_path / "nope")))
        Trainer(cfg, build_plan(cfg, 1))


def test_weights_only_start_from_a_model_only_export(tmp_path):
    train(
        args(
            tmp_path,
            "src",
            8,
            "--checkpoint.enable",
            "--checkpoint.interval",
            "100",
            "--checkpoint.last_save_model_only",
            "--checkpoint.export_dtype",
            "bfloat16",
        )
    )
    final = tmp_path / "src" / "checkpoint" / "step-8"
    info = json.loads((final / "titanrush.json").read_text())
    assert info["model_only"] is True and info["dtype"] == "bfloat16"
    rows = rows_of(tmp_path / "src")
    assert [r["step"] for r in rows if r.get("ckpt_mode") == "model_only"] == [8]
    with pytest.raises(ConfigError, match="holds only model weights"):
        cfg = config.load(None, args(tmp_path, "x", 2, "--checkpoint.load_path", str(final)))
        Trainer(cfg, build_plan(cfg, 1))
    cfg = config.load(
        None,
        args(tmp_path, "dst", 2, "--checkpoint.load_path", str(final), "--checkpoint.load_model_only"),
    )
    trainer = Trainer(cfg, build_plan(cfg, 1))
    assert trainer.step == 0  # a new run: step, optimizer and data start fresh
    trainer.train()
    trainer.close()
    fresh = losses(tmp_path / "src")
    assert losses(tmp_path / "dst")[1] < fresh[1] - 1.0  # starts from the trained weights


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    """Kill a real training process while it writes a large checkpoint; the earlier one stays usable."""
    # A wide vocabulary makes each save take long enough (about 0.5 GB) to be caught in the act.
    big = ("--model.vocab_size", "120000", "--checkpoint.enable", "--checkpoint.interval", "2")
    cmd = [sys.executable, "-m", "titanrush.train", *args(tmp_path, "kill", 10, *big)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ck = tmp_path / "kill" / "checkpoint"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:  # wait until step-2 is complete and step-4 is being written
            if (ck / "step-2").exists() and (ck / "step-4.tmp").exists():
                break
            if proc.poll() is not None:
                pytest.fail(f"training ended early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.005)
        else:
            pytest.fail("never saw the second save in progress")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not (ck / "step-4").exists()
    cfg = config.load(None, args(tmp_path, "kill", 4, *big))
    trainer = Trainer(cfg, build_plan(cfg, 1))
    assert trainer.step == 2
    trainer.train()
    trainer.close()
    assert (ck / "step-4").exists() and not (ck / "step-4.tmp").exists()  # the killed save's leftovers gone


def test_async_pinned_on_a_torch_whose_stager_closes_itself_uses_a_fresh_one_per_save(tmp_path, monkeypatch):
    # torch 2.11's DefaultStager cannot serve a second save (pytorch/pytorch#183413; it crashed the
    # 8B's second async_pinned save on the GPU machine). Where that is so, each save gets its own.
    import torch.distributed.checkpoint as dcp

    from titanrush.checkpoint import manager as ck

    stagers = []
    real = dcp.async_save

    def spy(state, **kw):
        stagers.append(kw.get("async_stager"))
        return real(state, **kw)

    monkeypatch.setattr(dcp, "async_save", spy)
    monkeypatch.setattr(ck, "stager_reusable", lambda: False)
    train(
        args(
            tmp_path,
            "a",
            6,
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.async_mode",
            "async_pinned",
        )
    )
    assert len(stagers) == 3 and len({id(s) for s in stagers}) == 3 and None not in stagers
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoint").iterdir()) == ["step-2", "step-4", "step-6"]
    monkeypatch.setattr(ck, "stager_reusable", lambda: True)
    stagers.clear()
    train(
        args(
            tmp_path,
            "b",
            4,
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.async_mode",
            "async_pinned",
        )
    )
    assert len(stagers) == 2 and stagers[0] is stagers[1]


def test_stager_reusable_matches_what_this_torchs_stager_does():
    # The check reads the torch version; this stages twice through one stager to see the behaviour itself.
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from titanrush.checkpoint.manager import stager_reusable

    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"w": torch.ones(4), "meta": {"step": 1, "kind": dict}}  # a class, as DTensor specs hold
    assert torch.equal(stager.stage(state)["w"], state["w"])
    try:
        stager.stage(state)
        reused = True
    except Exception:  # noqa: BLE001 - torch 2.11: KeyError from the closed stager's empty dispatch
        reused = False
    finally:
        stager.close()
    assert stager_reusable() is reused


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_barrier_names_this_ranks_device_to_nccl(monkeypatch, backend):
    # Communicators start lazily (no device bound at init): NCCL's barrier gets the current device, not
    # one guessed from the global rank.
    import torch.distributed as dist

    from titanrush import distributed

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    distributed.barrier()
    assert calls == ([{"device_ids": [2]}] if backend == "nccl" else [{}])


def test_every_model_argument_but_the_run_time_choices_is_compared():
    """A field added to ModelArgs or Llama4Args is compared unless it is listed as a run-time choice
    (checkpoint_compat.RUNTIME_ARGS): a checkpoint of another model must never load silently."""
    import dataclasses

    from titanrush.checkpoint.compat import RUNTIME_ARGS, model_arg_differences
    from titanrush.models.llama import FLAVORS
    from titanrush.models.llama4.flavors import FLAVORS as LLAMA4_FLAVORS

    every = set()
    for args in (FLAVORS["debug"], LLAMA4_FLAVORS["llama4_debug"]):
        base = dataclasses.asdict(dataclasses.replace(args, rope_scaling=True))
        fields = {f.name for f in dataclasses.fields(args)}
        every |= fields
        for name in sorted(fields):
            value = base[name]
            other = {
                bool: lambda v: not v,
                int: lambda v: v + 1,
                float: lambda v: v * 2,
                str: lambda v: v + "x",
            }.get(type(value), lambda v: 1.5)(value)  # None (ffn_dim_multiplier): a multiplier
            diffs = model_arg_differences(base, {**base, name: other})
            if name in RUNTIME_ARGS:
                assert diffs == [], (name, diffs)
            else:
                # one line; two where a field also sets a derived width (Llama 4's experts')
                assert 1 <= len(diffs) <= 2 and all("there" in d for d in diffs), (name, diffs)
    assert every >= RUNTIME_ARGS, RUNTIME_ARGS - every
    base = dataclasses.asdict(dataclasses.replace(FLAVORS["debug"], rope_scaling=True))
    assert model_arg_differences({**base, "n_kv_heads": None}, {**base, "n_kv_heads": base["n_heads"]}) == []


def test_block_checksums_match_zlib_over_any_range_and_stop_at_the_end_of_a_short_file(tmp_path):
    """The integrity record's per-block CRC (read with pread): any offset, page-aligned or not;
    a range past the end of the file stops at the end (a shorter file is reported by the size check)."""
    import zlib

    from titanrush.checkpoint.integrity import _crc_range

    data = os.urandom(3 * 4096 + 123)
    path = tmp_path / "shard"
    path.write_bytes(data)
    for offset, length in [(0, len(data)), (4096, 5000), (100, 7000), (len(data) - 5, 100), (len(data), 10)]:
        assert _crc_range(path, offset, length) == f"{zlib.crc32(data[offset : offset + length]):08x}"
    (tmp_path / "empty").write_bytes(b"")
    assert _crc_range(tmp_path / "empty", 0, 64) == f"{zlib.crc32(b''):08x}"


def test_findings_are_said_once_in_one_process_as_across_ranks():
    """A compatibility finding made twice (the optimizer and the schedule both saved by another optimizer)
    gives its advice once, without a process group as with one."""
    from titanrush.distributed import all_ranks

    assert all_ranks(["set optimizer", "resize", "set optimizer"]) == ["set optimizer", "resize"]
