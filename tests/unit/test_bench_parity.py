"""scripts/bench's parity mode (side_by_side.py --parity): the batch dump holds titanrush's batches and the
observers hash what the train step draws; the exported initial weights reload bitwise; both trainers'
configs carry the same settings; torchtitan's schedule shape; the report's checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from titanrush import config
from titanrush.data import build_dataloader, build_tokenizer
from titanrush.interop import hf
from titanrush.interop.hf_convert import import_hf
from titanrush.models.llama import Llama
from titanrush.models.llama4 import Llama4, Llama4Args
from titanrush.optim import lr_factor
from titanrush.run.plan import build_plan, resolve_model_args

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "bench" / "torchtitan_compat")]
import parity  # noqa: E402
import parity_observe  # noqa: E402
import parity_report as report  # noqa: E402
import side_by_side as sbs  # noqa: E402
from batch_dump import DumpReader, HashLog, batch_hash, read_lines  # noqa: E402

SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]


def small_cfg(flavor: str = "debug", *extra: str) -> config.JobConfig:
    return config.load(None, ["--model.flavor", flavor, *SMALL, *extra])


def loader(cfg: config.JobConfig, rank: int, dp: int, batch: int | None = None):
    t = cfg.training
    return build_dataloader(
        cfg.data,
        tokenizer=build_tokenizer(cfg.data.tokenizer),
        seq_len=t.seq_len,
        local_batch_size=batch or t.local_batch_size,
        dp_rank=rank,
        dp_degree=dp,
        seed=t.seed,
        vocab_size=resolve_model_args(cfg).vocab_size,
    )


def test_the_dump_holds_each_ranks_batches_of_titanrushs_loader_in_order(tmp_path):
    cfg = small_cfg()
    meta = parity.dump_batches(cfg, resolve_model_args(cfg), steps=5, dp=2, folder=tmp_path)
    dump = DumpReader(tmp_path)
    assert (dump.steps, dump.ranks, dump.local_batch, dump.seq_len) == (5, 2, 2, 64)
    whole = iter(loader(cfg, 0, 1, batch=4))  # one rank reading both ranks' windows
    ranks = [iter(loader(cfg, r, 2)) for r in range(2)]
    for step in range(1, 6):
        both = next(whole)
        for r, it in enumerate(ranks):
            b = next(it)  # a fresh loader: what the trainer of rank r reads at this step
            inputs, labels = dump.batch(step, r)
            assert torch.equal(inputs, b.input_ids) and torch.equal(labels, b.labels)
            assert meta["hashes"][step - 1][r] == batch_hash(b.input_ids, b.labels)
            assert torch.equal(inputs, both.input_ids[2 * r : 2 * r + 2])  # the same windows on any mesh
        # a batch hash tells batches apart (labels too)
        assert batch_hash(inputs, labels) != batch_hash(inputs, labels.roll(1))


def test_hashed_hands_out_the_batches_unchanged_and_logs_their_hashes(tmp_path):
    cfg = small_cfg()
    meta = parity.dump_batches(cfg, resolve_model_args(cfg), steps=3, dp=1, folder=tmp_path / "dump")
    it, log = iter(loader(cfg, 0, 1)), HashLog(tmp_path / "tokens_rank0.jsonl")
    for step in range(1, 4):
        batch = next(parity_observe.Hashed(it, log, step, 0))
        assert batch_hash(batch.input_ids, batch.labels) == meta["hashes"][step - 1][0]
    assert [r["hash"] for r in read_lines([log.path])] == [h[0] for h in meta["hashes"]]


def fresh_state(args, seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = (Llama4 if isinstance(args, Llama4Args) else Llama)(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.state_dict()


@pytest.mark.parametrize("flavor", ["debug", "llama4_debug"])
def test_exported_initial_weights_reload_bitwise(flavor, tmp_path):
    args = resolve_model_args(small_cfg(flavor))
    hashes = parity.export_weights(args, 7, tmp_path / "hf", torch.device("cpu"))
    want = fresh_state(args, 7)
    sd, back_args, info = hf.read_checkpoint(import_hf(tmp_path / "hf", tmp_path / "imported"))
    params = {k: v for k, v in want.items() if not k.endswith((".expert_bias", "tokens_per_expert"))}
    for k, v in params.items():
        assert sd[k].dtype == v.dtype == torch.float32 and torch.equal(sd[k], v), k
    assert info["model_only"] and back_args.n_layers == args.n_layers
    exported = hf.load_safetensors(tmp_path / "hf" / "model.safetensors")
    prefix = "language_model." if flavor.startswith("llama4") else ""
    assert all(k.startswith(prefix + "model.") or k == prefix + "lm_head.weight" for k in exported)
    assert hashes == parity_report_hashes(want, args) and len(hashes) == len(exported)
    assert parity.export_weights(args, 8, tmp_path / "other", torch.device("cpu")) != hashes


def parity_report_hashes(sd: dict[str, torch.Tensor], args) -> dict[str, str]:
    from batch_dump import weight_hashes

    return weight_hashes(parity.export_state_dict(sd, args))


def test_titanrushs_side_starts_from_the_export_and_draws_the_dumps_batches(tmp_path, monkeypatch):
    """The titanrush half of a parity run on the CPU, in this process: prepare, then 3 observed steps from
    the imported weights; the observer's hashes are the export's and the dump's."""
    from titanrush import trainer as trainer_module

    monkeypatch.setattr(trainer_module.Trainer, "train_step", trainer_module.Trainer.train_step)
    flags = ["--model.flavor", "debug", *SMALL, "--training.steps", "3", "--metrics.log_freq", "1"]
    flags += ["--metrics.tensorboard", "false"]
    flags += ["--job.dump_folder", str(tmp_path / "runs"), *parity.titanrush_flags()]
    prep = parity.prepare(flags, steps=3, dp=1, scratch=tmp_path / "scratch")
    parity_observe.observe(tmp_path / "obs")
    load = ["--checkpoint.load_path", str(prep.checkpoint), "--checkpoint.load_model_only"]
    cfg = config.load(None, [*flags, *load])
    trainer = trainer_module.Trainer(cfg, build_plan(cfg, 1))
    try:
        trainer.train()
    finally:
        trainer.close()
    seen = report.titanrush_trace(tmp_path / "runs" / "debug", tmp_path / "obs")
    assert seen.weights == prep.weights
    assert {k: v for k, v in seen.tokens.items()} == {(s + 1, 0): {h[0]} for s, h in enumerate(prep.tokens)}
    assert sorted(seen.loss) == [1, 2, 3]


def test_both_trainers_configs_carry_the_parity_settings(tmp_path):
    s = parity.SETTINGS
    for name in ("1b", "1b_fsdp2", "moe", "debug"):
        row = sbs.ROWS[name]
        cfg = config.load(None, sbs.parity_flags(row, 200, "x", tmp_path))
        o, sch = cfg.optimizer, cfg.lr_scheduler
        assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay) == (
            s["lr"],
            s["beta1"],
            s["beta2"],
            s["eps"],
            s["weight_decay"],
        )
        assert (sch.warmup_steps, sch.decay, sch.min_lr_factor) == (
            s["warmup_steps"],
            s["decay"],
            s["min_lr_factor"],
        )
        assert cfg.training.max_norm == s["max_norm"] and o.implementation == "fused"
        assert cfg.metrics.log_freq == 1 and cfg.training.global_batch_size == -1
        if row.flavor.startswith("llama4"):  # torchtitan's routing: its bias step, no balance loss
            assert cfg.moe.bias_update_rate == s["bias_update_rate"] and cfg.moe.aux_loss_coeff == 0
        tt = sbs.torchtitan_config(row, 200, tmp_path, tmp_path, tmp_path)
        parity.torchtitan_parity(tt, parity.Prepared.at(tmp_path))
        tt = tomllib.loads(sbs.toml_text(tt))
        o, sch = tt["optimizer"], tt["lr_scheduler"]
        assert (o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"]) == (
            s["lr"],
            s["beta1"],
            s["beta2"],
            s["eps"],
            s["weight_decay"],
        )
        assert (sch["warmup_steps"], sch["decay_type"], sch["min_lr_factor"]) == (
            s["warmup_steps"],
            s["decay"],
            s["min_lr_factor"],
        )
        assert "decay_ratio" not in sch and tt["training"]["max_norm"] == s["max_norm"]
        assert (o["name"], o["implementation"], tt["metrics"]["log_freq"]) == ("AdamW", "fused", 1)
        ck = tt["checkpoint"]
        assert (
            ck["initial_load_in_hf"] and ck["initial_load_path"] == str(tmp_path / "hf") and ck["load_only"]
        )
        assert tt["model"]["name"] in ("llama3_parity", "llama4_parity")
        assert tt["experimental"]["custom_import"] == "tt_parity"
        assert tt["training"]["dataset_path"] == str(tmp_path / "batches")
        assert (cfg.model.flavor, cfg.training.seq_len) == (tt["model"]["flavor"], tt["training"]["seq_len"])


def test_torchtitan_schedule_is_titanrushs_one_step_later_after_the_warmup():
    """Values of torchtitan 0.2.2's build_lr_schedulers (warm-up 10 of 200 steps, linear to 0.1; no
    warm-up, 20 steps, linear to 0), read from torchtitan itself."""
    tt = parity_observe.torchtitan_schedule(lr_factor)
    kw = dict(warmup_steps=10, total_steps=200, decay="linear", decay_ratio=0.2, min_lr_factor=0.1)
    got = [tt(k, **kw) for k in (1, 10, 11, 12, 13, 200)]
    assert got == pytest.approx([0.1, 1.0, 1.0, 0.9952631578947368, 0.9905263157894737, 0.10473684210526318])
    assert [lr_factor(k, **kw) for k in (11, 200)] == pytest.approx([0.9952631578947368, 0.1])
    kw = dict(warmup_steps=0, total_steps=20, decay="linear", decay_ratio=0.2, min_lr_factor=0.0)
    assert [tt(k, **kw) for k in (1, 2, 3, 20)] == pytest.approx([1.0, 0.95, 0.9, 0.05])


def trace(losses: list[float], tokens: list[str], weights: dict[str, str]) -> report.Trace:
    t = report.Trace(weights=dict(weights))
    for s, loss in enumerate(losses, start=1):
        t.loss[s], t.grad_norm[s], t.lr[s] = loss, 1.0, 1e-4
        t.tokens[(s, 0)] = {tokens[s - 1]}
    return t


def test_the_report_proves_the_inputs_before_it_compares_losses():
    tokens, weights = [f"h{s}" for s in range(1, 41)], {"a": "1", "b": "2"}
    ref = trace([5.0] * 40, tokens, weights)
    same = report.check_inputs(trace([5.0] * 40, tokens, weights), ref, [[h] for h in tokens], weights)
    assert same["identical"] and same["token_batches"] == 40
    other = trace([5.0] * 40, tokens, weights)
    other.tokens[(7, 0)] = {"x"}
    other.weights["b"] = "3"
    bad = report.check_inputs(other, ref, [[h] for h in tokens], weights)
    assert not bad["identical"] and bad["token_steps_differing"] == [7] and bad["weights_differing"] == ["b"]

    losses = [5.0] * 40
    losses[3] = 5.0 * 1.008  # within 1% at step 4; the last quarter (steps 30-40) within 0.5%
    fig = report.compare(trace(losses, tokens, weights), ref, 40, moe=False)
    assert fig["first"] == (1, 10) and fig["last"] == (30, 40)
    assert fig["loss_first_max_step"] == 4 and fig["goal_first"] and fig["goal_last"]
    losses[35] = 5.0 * 1.1  # one step 10% off: the last quarter's mean 0.9% off
    fig = report.compare(trace(losses, tokens, weights), ref, 40, moe=False)
    assert fig["goal_first"] and not fig["goal_last"]
    text = report.markdown("x", same, fig, moe=False)
    assert "Inputs identical" in text and "**no**" in text


def test_parity_dry_run_prints_torchtitan_then_titanrush_runs(tmp_path, capsys):
    assert (
        sbs.main(["--out", str(tmp_path), "--parity", "--rows", "1b", "--ablate-schedule", "--dry-run"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0] for line in lines] == [
        "[torchtitan 1b parity",
        "[titanrush 1b parity",
        "[titanrush 1b parity, torchtitan's lr schedule",
    ]
    assert "tt_cpu.py" in lines[0] and "TT_PARITY_OUT=" in lines[0]  # (no GPU here: the CPU check)
    assert all("parity_observe.py" in x and "--checkpoint.load_model_only" in x for x in lines[1:])
    assert "--lr-schedule torchtitan" in lines[2] and "--compile.enable" not in lines[1]
    assert f"TT_LOAD_BALANCE_COEFF={parity.SETTINGS['bias_update_rate']}" in lines[0]
    a = sbs.parse_args(["--out", str(tmp_path), "--parity", "--rows", "1b"])
    gpu = sbs.parity_runs(sbs.ROWS["1b"], a, tmp_path, parity.Prepared.at(tmp_path), cpu=False)
    assert "-m torchtitan.train" in gpu[0].shell() and "--compile.enable" in gpu[1].shell()
    toml = tomllib.loads((tmp_path / "configs" / "torchtitan_parity_1b.toml").read_text())
    assert toml["model"]["name"] == "llama3_parity" and toml["training"]["steps"] == 200
    assert sbs.parse_args(["--out", str(tmp_path), "--parity", "--steps", "8"]).steps == 8  # (any length)
    with pytest.raises(SystemExit):
        sbs.parse_args(["--out", str(tmp_path), "--parity", "--rows", "8b_pp2_fsdp2"])
    with pytest.raises(SystemExit):
        sbs.parse_args(["--out", str(tmp_path), "--parity", "--flags=--training.seed 1"])


def test_torchtitan_reads_the_dump_in_order(tmp_path, monkeypatch):
    """tt_parity's loader (where torchtitan 0.2.2 is importable): this rank's batches, step after step."""
    import tt_cpu

    monkeypatch.setitem(sys.modules, "torchtitan.models.moe.kernels", tt_cpu.no_triton_kernels())
    pytest.importorskip("torchtitan")
    if importlib.util.find_spec("datasets") is None:  # (side_by_side.py's stand-in, as on the GPU machine)
        monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench" / "torchtitan_compat" / "shim"))
    monkeypatch.setenv("TT_PARITY_OUT", str(tmp_path / "obs"))
    monkeypatch.delitem(sys.modules, "tt_parity", raising=False)
    import tt_parity

    cfg = small_cfg()
    meta = parity.dump_batches(cfg, resolve_model_args(cfg), steps=4, dp=2, folder=tmp_path / "dump")
    dl = tt_parity.DumpLoader(str(tmp_path / "dump"), dp_rank=1, dp_degree=2, local_batch=2, seq_len=64)
    got = [batch_hash(x["input"], y) for x, y in dl]
    assert got == [h[1] for h in meta["hashes"]]
    assert [r["hash"] for r in read_lines([tmp_path / "obs" / "tokens_rank0.jsonl"])] == got
    with pytest.raises(ValueError, match="ranks, batch, seq_len"):
        tt_parity.DumpLoader(str(tmp_path / "dump"), dp_rank=0, dp_degree=1, local_batch=2, seq_len=64)
