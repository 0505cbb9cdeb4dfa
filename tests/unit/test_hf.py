"""Checkpoint interchange: titanrush <-> HF Llama names, the RoPE permutation, safetensors, files, errors."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanrush.config import ConfigError
from titanrush.data.tokenizer import build_tokenizer
from titanrush.interop import hf, hf_convert
from titanrush.models.llama import FLAVORS, Llama, ModelArgs, model_args
from titanrush.models.llama.model import apply_rope, rope_cache
from titanrush.tools import convert

TOKENIZER_FILES = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
NO_DEV = "it is in [dev] (pip install -e '.[dev]')"
NO_TRANSFORMERS = "transformers is not installed: " + NO_DEV


def make_model(args: ModelArgs, seed: int = 0) -> Llama:
    """A debug-sized model with random weights; norms perturbed so that swapping two of them shows."""
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save_checkpoint(model: Llama, folder: Path, step: int = 5, drop_tied_output: bool = False) -> Path:
    """A trainer-style checkpoint: DCP `model.*` keys (+ an unrelated entry) and titanrush.json."""
    path = folder / f"step-{step}"
    sd = model.state_dict()
    if drop_tied_output:
        sd.pop("output.weight")
    dcp.save({"model": sd, "train_state": {"step": step}}, checkpoint_id=str(path), no_dist=True)
    args = dataclasses.asdict(model.args)
    info = {"step": step, "flavor": "debug", "model_args": args, "model_only": False, "dtype": "float32"}
    (path / "titanrush.json").write_text(json.dumps(info))
    return path


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kv_heads", [4, 8], ids=["gqa", "mha"])
def test_titanrush_to_hf_and_back_is_exact(tied, kv_heads):
    args = model_args("debug", tie_embeddings=tied, n_kv_heads=kv_heads)
    sd = make_model(args).state_dict()
    hf_sd = hf.to_hf_state_dict(sd, args)
    assert ("lm_head.weight" in hf_sd) is not tied
    assert len(hf_sd) == 2 + 9 * args.n_layers + (not tied)
    assert hf_sd["model.layers.1.self_attn.k_proj.weight"].shape == (kv_heads * args.head_dim, args.dim)
    assert hf_sd["model.layers.0.mlp.gate_proj.weight"] is sd["layers.0.feed_forward.w1.weight"]
    assert hf_sd["model.layers.0.mlp.down_proj.weight"] is sd["layers.0.feed_forward.w2.weight"]
    assert not torch.equal(
        hf_sd["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"]
    )
    back = hf.from_hf_state_dict(hf_sd, args)
    assert_same_state(back, sd)
    if tied:
        assert back["output.weight"] is back["tok_embeddings.weight"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def hf_inv_freq(cfg: dict, head_dim: int) -> torch.Tensor:
    """HF's inverse frequencies from a config.json, llama3 scaling included (written from HF's recipe)."""
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rs = cfg["rope_scaling"]
    if rs is None:
        return inv
    old = rs["original_max_position_embeddings"]
    low_wl, high_wl = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
    wl = 2 * math.pi / inv
    out = torch.where(wl > low_wl, inv / rs["factor"], inv)
    smooth = (old / wl - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
    mid = (wl <= low_wl) & (wl >= high_wl)
    return torch.where(mid, (1 - smooth) * out / rs["factor"] + smooth * out, out)


def hf_scores(x, q_proj, k_proj, cfg, n_heads, kv_heads):
    """q.k scores of an HF-style attention: rotate_half RoPE with cos/sin = cat(freqs, freqs)."""
    bsz, seq, _ = x.shape
    d = q_proj.shape[0] // n_heads
    q = (x @ q_proj.T).view(bsz, seq, n_heads, d).transpose(1, 2)  # (B, H, T, D)
    k = (x @ k_proj.T).view(bsz, seq, kv_heads, d).transpose(1, 2)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), hf_inv_freq(cfg, d))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()  # (T, D)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(n_heads // kv_heads, dim=1)
    return q @ k.transpose(-1, -2)  # (B, H, T, T)


def titanrush_scores(x, wq, wk, args):
    bsz, seq, _ = x.shape
    q = (x @ wq.T).view(bsz, seq, -1, args.head_dim)
    k = (x @ wk.T).view(bsz, seq, -1, args.head_dim)
    rope = rope_cache(args, seq)
    q, k = apply_rope(q, rope).transpose(1, 2), apply_rope(k, rope).transpose(1, 2)
    k = k.repeat_interleave(args.n_heads // args.kv_heads, dim=1)
    return q @ k.transpose(-1, -2)


@pytest.mark.parametrize("rope_scaling", [False, True], ids=["plain_rope", "llama3_rope"])
def test_permuted_projections_give_titanrush_scores_under_hf_rope(rope_scaling):
    args = model_args("debug", rope_scaling=rope_scaling, rope_original_max_len=64, rope_theta=10000.0)
    sd = make_model(args).state_dict()
    hf_sd = hf.to_hf_state_dict(sd, args)
    cfg = json.loads(json.dumps(hf.hf_config(args)))
    x = torch.randn(2, 48, args.dim, generator=torch.Generator().manual_seed(3))
    wq, wk = sd["layers.2.attention.wq.weight"], sd["layers.2.attention.wk.weight"]
    ours = titanrush_scores(x, wq, wk, args)
    q_proj, k_proj = (
        hf_sd["model.layers.2.self_attn.q_proj.weight"],
        hf_sd["model.layers.2.self_attn.k_proj.weight"],
    )
    theirs = hf_scores(x, q_proj, k_proj, cfg, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    # The check has teeth: without the permutation the scores differ.
    unpermuted = hf_scores(x, wq, wk, cfg, args.n_heads, args.kv_heads)
    assert (unpermuted - ours).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(FLAVORS))
def test_hf_config_round_trips_every_flavor(name):
    args = FLAVORS[name]
    cfg = json.loads(json.dumps(hf.hf_config(args)))
    assert cfg["intermediate_size"] == args.ffn_hidden and cfg["head_dim"] == args.head_dim
    assert cfg["tie_word_embeddings"] is args.tie_embeddings
    assert (cfg["rope_scaling"] or {}).get("rope_type") == ("llama3" if args.rope_scaling else None)
    assert hf.args_from_hf_config(cfg) == args
    assert hf.flavor_of(hf.args_from_hf_config(cfg)) == name


# Meta's published config.json of Llama 3.1 8B and Llama 3.2 1B (as on the Hugging Face hub).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA32_1B = {
    **LLAMA31_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": 32.0},
    "tie_word_embeddings": True,
}


# transformers >= 5 writes the RoPE settings, theta included, under rope_parameters.
LLAMA31_8B_V5 = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
LLAMA31_8B_V5["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}


@pytest.mark.parametrize(
    "cfg, name", [(LLAMA31_8B, "8B"), (LLAMA31_8B_V5, "8B"), (LLAMA32_1B, "1B")], ids=["8B", "8B_v5", "1B"]
)
def test_published_configs_map_to_the_flavors(cfg, name):
    args = hf.args_from_hf_config(cfg)
    assert args == FLAVORS[name]
    assert hf.flavor_of(args) == name
    # a training run's RoPE table length (its sequence length) is not part of the model's identity
    assert hf.flavor_of(dataclasses.replace(args, rope_positions=8192)) == name


@pytest.mark.parametrize("hidden", [704, 1000, 100, 4097, 2048])
def test_any_intermediate_size_is_reproduced(hidden):
    cfg = {**hf.hf_config(model_args("debug")), "intermediate_size": hidden}
    args = hf.args_from_hf_config(cfg)
    assert args.ffn_hidden == hidden
    assert hf.flavor_of(args) == ("debug" if hidden == 704 else "custom")


def test_safetensors_round_trip(tmp_path):
    tensors = {
        "w": torch.randn(3, 5),
        "b": torch.randn(7).bfloat16(),
        "h": torch.randn(2, 2).half(),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "d": torch.randn(3, dtype=torch.float64),
        "strided": torch.randn(4, 6)[:, ::2],
    }
    path = tmp_path / "x.safetensors"
    hf.save_safetensors(tensors, path, {"format": "pt"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert (
        header["b"]["dtype"] == "BF16" and header["ids"]["dtype"] == "I64" and header["scalar"]["shape"] == []
    )
    assert len(raw) == 8 + n + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert_same_state(hf.load_safetensors(path), {k: v.contiguous() for k, v in tensors.items()})


def test_safetensors_agrees_with_the_reference_package(tmp_path):
    st = pytest.importorskip("safetensors.torch", reason="the safetensors package is not installed here")
    from safetensors import safe_open

    tensors = {
        "a": torch.randn(4, 3),
        "b": torch.randn(5).bfloat16(),
        "c": torch.arange(3),
        "d": torch.ones(2).half(),
    }
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    hf.save_safetensors(tensors, ours, {"format": "pt", "step": "3"})
    st.save_file(tensors, str(theirs), metadata={"format": "pt"})
    assert_same_state(st.load_file(str(ours)), tensors)
    assert_same_state(hf.load_safetensors(theirs), tensors)
    with safe_open(str(ours), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "3"}


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    path = tmp_path / "model.safetensors"
    hf.save_safetensors({"a": torch.randn(100)}, path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ConfigError, match="is truncated: tensor a ends at byte 472, the file has 464"):
        hf.load_safetensors(path)
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(ConfigError, match="is truncated or not a safetensors file"):
        hf.load_safetensors(path)


@pytest.mark.parametrize(
    "tied, drop", [(False, False), (True, False), (True, True)], ids=["untied", "tied", "tied_output_absent"]
)
def test_export_hf_and_import_hf_through_files(tmp_path, tied, drop):
    args = model_args("debug", tie_embeddings=tied)
    model = make_model(args)
    save_checkpoint(model, tmp_path / "run" / "checkpoint", step=2)
    ckpt = save_checkpoint(model, tmp_path / "run" / "checkpoint", step=5, drop_tied_output=drop)
    out = hf_convert.export_hf(ckpt, tmp_path / "hf", dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES]
    )
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["torch_dtype"] == "float32"
        and cfg["model_type"] == "llama"
        and cfg["tie_word_embeddings"] is tied
    )
    tok = build_tokenizer("default")  # no config.toml above the checkpoint: the shipped tokenizer
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert_same_state(
        hf.load_safetensors(out / "model.safetensors"), hf.to_hf_state_dict(model.state_dict(), args)
    )

    imported = hf_convert.import_hf(out, tmp_path / "imported")
    info = json.loads((imported / "titanrush.json").read_text())
    assert info["model_only"] and info["step"] == 0 and info["dtype"] == "float32"
    # A run takes the shape from model_args (model.flavor = custom); the matching flavor is only named.
    assert info["flavor"] == "custom" and info["architecture"] == "debug"
    assert sorted(p.name for p in imported.iterdir() if p.suffix == ".json") == sorted(
        ["titanrush.json", "integrity.json", *TOKENIZER_FILES]
    )  # the tokenizer travels with the weights
    # The import is recorded like a save: a run from it verifies its bytes (no "not verified" warning).
    from titanrush.checkpoint import integrity

    record = integrity.read_record(imported)
    assert info["integrity"] == integrity.RECORD_FILE and record is not None
    assert set(record["files"]) == {p.name for p in imported.iterdir()} - {integrity.RECORD_FILE}
    assert integrity.verify(imported, record) == []
    sd, back_args, _ = hf.read_checkpoint(imported)
    assert back_args == args
    assert_same_state(sd, model.state_dict())
    reloaded = Llama(back_args)
    reloaded.load_state_dict(sd)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(tokens), model(tokens), atol=0, rtol=0)
    # The checkpoint folder itself (not a step) resolves to its newest step.
    assert hf.read_checkpoint(tmp_path / "run" / "checkpoint")[2]["step"] == 5


def test_bf16_export_and_sharded_hf_import(tmp_path):
    args = model_args("debug")
    model = make_model(args)
    out = hf_convert.export_hf(save_checkpoint(model, tmp_path / "ck"), tmp_path / "hf")  # default: bf16
    cfg = json.loads((out / "config.json").read_text())
    weights = hf.load_safetensors(out / "model.safetensors")
    assert cfg["torch_dtype"] == "bfloat16" and all(v.dtype == torch.bfloat16 for v in weights.values())
    want = {k: v.bfloat16() for k, v in hf.to_hf_state_dict(model.state_dict(), args).items()}
    assert_same_state(weights, want)
    # Re-shard the export the way HF does (two files + an index), then import it.
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text(json.dumps(cfg))
    names = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        hf.save_safetensors({k: weights[k] for k in keys}, shard / file, {"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    sd, _, _ = hf.read_checkpoint(hf_convert.import_hf(shard, tmp_path / "imported"))
    assert_same_state(sd, {k: v.bfloat16().float() for k, v in model.state_dict().items()})


def test_export_pt_is_a_loadable_state_dict(tmp_path):
    model = make_model(model_args("debug", tie_embeddings=True))
    out = hf_convert.export_pt(save_checkpoint(model, tmp_path / "ck"), tmp_path / "out" / "model.pt")
    blob = torch.load(out, weights_only=True)
    assert blob["step"] == 5 and blob["flavor"] == "debug"
    fresh = Llama(ModelArgs(**blob["model_args"]))
    fresh.load_state_dict(blob["model"])  # strict: every key, shape and the tied output
    assert_same_state(fresh.state_dict(), model.state_dict())
    assert [p.name for p in out.parent.iterdir()] == ["model.pt"]  # no temporary left behind


def test_cli_round_trip(tmp_path, capsys):
    from titanrush import cli

    model = make_model(model_args("debug"))
    ckpt = save_checkpoint(model, tmp_path / "ck")
    assert cli.main(["convert", "--to-hf", str(ckpt), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert convert.main(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    printed = capsys.readouterr().out
    for flag in hf.import_command(tmp_path / "back"):
        assert flag in printed
    assert_same_state(hf.read_checkpoint(tmp_path / "back")[0], model.state_dict())
    assert convert.main(["--to-pt", str(ckpt), str(tmp_path / "m.pt"), "--dtype", "bf16"]) == 0
    assert torch.load(tmp_path / "m.pt", weights_only=True)["model"]["norm.weight"].dtype == torch.bfloat16
    assert convert.main(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "x"), "--dtype", "bf16"]) == 2
    assert convert.main(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "x"), "--tokenizer", "none"]) == 2
    assert not (tmp_path / "x").exists()
    assert convert.main(["--to-hf", str(ckpt), str(tmp_path / "bare"), "--tokenizer", "none"]) == 0
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert "bos_token_id" not in json.loads((tmp_path / "bare" / "config.json").read_text())
    assert convert.main([]) == 2
    assert convert.main(["--help"]) == 0


def test_errors_name_the_problem_and_write_nothing(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="does not exist"):
        hf_convert.export_hf(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no titanrush.json"):
        hf_convert.export_pt(tmp_path / "empty", tmp_path / "x.pt")
    (tmp_path / "half" / "step-3").mkdir(parents=True)
    (tmp_path / "half" / "step-3" / "titanrush.json").write_text("{}")
    with pytest.raises(ConfigError, match="no DCP .metadata"):
        hf.read_checkpoint(tmp_path / "half" / "step-3")
    assert convert.main(["--to-hf", str(missing), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err

    model = make_model(model_args("debug"))
    out = hf_convert.export_hf(save_checkpoint(model, tmp_path / "ck"), tmp_path / "hf", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ConfigError, match="only Llama"):
        hf_convert.import_hf(out, tmp_path / "imp")
    (out / "config.json").write_text(
        json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    )
    with pytest.raises(ConfigError, match="yarn"):
        hf_convert.import_hf(out, tmp_path / "imp")
    (out / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 768}))
    with pytest.raises(
        ConfigError, match=r"do not match config.json: .*w1.weight \(704, 256\) \(expected \(768, 256\)"
    ):
        hf_convert.import_hf(out, tmp_path / "imp")
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"no place for: model.layers.3"):
        hf_convert.import_hf(out, tmp_path / "imp")
    for key, value in (("hidden_size", "abc"), ("num_attention_heads", 0), ("vocab_size", 2.5)):
        (out / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError, match=f"config.json has {key} = {value!r}: a whole number >= 1"):
            hf_convert.import_hf(out, tmp_path / "imp")
    (out / "config.json").write_text(json.dumps({**cfg, "rope_theta": "abc"}))
    with pytest.raises(ConfigError, match=r"config.json of a Llama lacks or mistypes a value \(ValueError"):
        hf_convert.import_hf(out, tmp_path / "imp")
    (out / "config.json").write_text(json.dumps(cfg))
    weights = hf.load_safetensors(out / "model.safetensors")
    del weights["model.layers.3.mlp.up_proj.weight"]
    hf.save_safetensors(weights, out / "model.safetensors", {"format": "pt"})
    with pytest.raises(ConfigError, match=r"lack model.layers.3.mlp.up_proj.weight"):
        hf_convert.import_hf(out, tmp_path / "imp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "empty", "half", "hf"]  # no output, no temp
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        hf_convert.import_hf(out, tmp_path / "busy")


def trainer_weights(trainer) -> dict[str, torch.Tensor]:
    return {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in trainer.model.state_dict().items()}


TRAIN = ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2"]


def test_trainer_written_checkpoints_export(tmp_path):
    from titanrush import config
    from titanrush.run.plan import build_plan
    from titanrush.trainer import Trainer

    argv = [
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "run",
        *TRAIN,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
    ]
    cfg = config.load(None, argv)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        trainer.train()
        trained, args = trainer_weights(trainer), trainer.plan.args
    finally:
        trainer.close()
    ck = tmp_path / "run" / "checkpoint"
    sd, _, info = hf.read_checkpoint(ck)  # the newest: step 2, model-only bf16
    assert info["step"] == 2 and info["model_only"] and sd["norm.weight"].dtype == torch.bfloat16
    assert_same_state(sd, {k: v.bfloat16() for k, v in trained.items()})
    out = hf_convert.export_hf(ck / "step-1", tmp_path / "hf", dtype=torch.float32)  # step 1: full fp32 state
    back = hf.from_hf_state_dict(hf.load_safetensors(out / "model.safetensors"), args)
    assert sorted(back) == sorted(trained) and not torch.equal(back["norm.weight"], trained["norm.weight"])


def test_damaged_checkpoints_and_existing_outputs_are_refused(tmp_path, capsys):
    """convert and generate check the integrity record as a resume does; no DCP traceback on a file that
    cannot be read; an export never writes over a file or into a non-empty folder."""
    from titanrush import config
    from titanrush.run.plan import build_plan
    from titanrush.tools import convert, generate
    from titanrush.trainer import Trainer

    argv = [
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "run",
        *TRAIN,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    cfg = config.load(None, argv)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        trainer.train()
    finally:
        trainer.close()
    capsys.readouterr()  # (the run's log lines)
    good = tmp_path / "run" / "checkpoint" / "step-2"
    flipped, cut = tmp_path / "flipped", tmp_path / "cut"
    shutil.copytree(good, flipped)
    shutil.copytree(good, cut)
    data = next(flipped.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 4] = bytes(4 * [0x7F])  # (a weight's bytes: DCP reads them fine)
    data.write_bytes(bytes(raw))
    (cut / "integrity.json").unlink()  # a folder with no record: the shard's length against .metadata
    with open(next(cut.glob("*.distcp")), "r+b") as f:
        f.truncate(1000)
    cases = [
        (convert.main, ["--to-pt", str(flipped), str(tmp_path / "a.pt")], "is corrupt: __0_0.distcp bytes"),
        (
            generate.main,
            ["--checkpoint", str(flipped), "--prompt", "x", "--max-new-tokens", "1"],
            "is corrupt",
        ),
        (convert.main, ["--to-hf", str(cut), str(tmp_path / "b")], "__0_0.distcp has 1,000 bytes"),
        (convert.main, ["--to-pt", str(good), str(tmp_path / "run" / "config.toml")], "exists"),
        (convert.main, ["--to-hf", str(good), str(good)], "not empty"),
    ]
    before = (tmp_path / "run" / "config.toml").read_bytes()
    for main, args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b").exists()
    assert (tmp_path / "run" / "config.toml").read_bytes() == before
    assert sorted(p.name for p in good.iterdir()) == sorted(p.name for p in flipped.iterdir())
    assert convert.main(["--to-pt", str(good), str(tmp_path / "a.pt")]) == 0  # the sound folder exports


def start_from_import(tmp_path: Path, flags_of) -> None:
    """A run starts from an imported checkpoint with exactly its weights, at step 0."""
    from titanrush import config
    from titanrush.run.plan import build_plan
    from titanrush.trainer import Trainer

    model = make_model(model_args("debug"), seed=7)
    out = hf_convert.export_hf(save_checkpoint(model, tmp_path / "ck"), tmp_path / "hf", dtype=torch.float32)
    imported = hf_convert.import_hf(out, tmp_path / "imported")
    argv = ["--job.dump_folder", str(tmp_path), "--job.name", "ft", *TRAIN, *flags_of(imported)]
    cfg = config.load(None, argv)
    trainer = Trainer(cfg, build_plan(cfg, 1))
    try:
        loaded = trainer_weights(trainer)
        assert_same_state({k: loaded[k].float() for k in model.state_dict()}, model.state_dict())
        assert trainer.step == 0
    finally:
        trainer.close()


def test_trainer_starts_from_an_imported_checkpoint(tmp_path):
    """The command `titanrush convert --from-hf` prints: the shape from the checkpoint, in one command."""
    pytest.importorskip("tokenizers", reason="the command trains with the import's tokenizer.json: " + NO_DEV)
    start_from_import(tmp_path, hf.import_command)


def test_trainer_starts_from_an_import_under_the_flavor_it_matches(tmp_path):
    """Checkpoints are compared by their model arguments, not their flavor's name: an import whose shape
    is a built-in flavor's starts a run under that flavor."""

    def named(imported: Path) -> list[str]:
        return [
            "--model.flavor",
            "debug",
            "--checkpoint.load_path",
            str(imported),
            "--checkpoint.load_model_only",
        ]

    start_from_import(tmp_path, named)


@pytest.mark.parametrize(
    "tied, rope_scaling", [(False, True), (True, False)], ids=["untied_llama3rope", "tied"]
)
def test_transformers_llama_gives_titanrush_logits(tmp_path, tied, rope_scaling):
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    over = {"rope_scaling": True, "rope_original_max_len": 64} if rope_scaling else {}
    args = model_args("debug", tie_embeddings=tied, **over)
    model = make_model(args, seed=3)
    out = hf_convert.export_hf(save_checkpoint(model, tmp_path / "ck"), tmp_path / "hf", dtype=torch.float32)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out)).float().eval()
    tokens = torch.randint(0, args.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)
        torch.testing.assert_close(theirs(input_ids=tokens).logits, want, atol=1e-4, rtol=1e-4)
    # And back: a folder written by transformers itself imports to the same model.
    theirs.save_pretrained(str(tmp_path / "saved"))
    sd, back_args, _ = hf.read_checkpoint(hf_convert.import_hf(tmp_path / "saved", tmp_path / "imported"))
    assert back_args == args
    assert_same_state(sd, model.state_dict())


def test_model_args_at_reads_every_kind_of_folder(tmp_path):
    args = model_args("debug", n_layers=2, tie_embeddings=True)
    run = tmp_path / "run" / "checkpoint"
    save_checkpoint(make_model(args), run, step=3)
    step = save_checkpoint(make_model(args), run, step=7)
    (step.parent.parent / "config.toml").write_text('[data]\ntokenizer = "/somewhere/tokenizer.model"\n')
    out = hf_convert.export_hf(step, tmp_path / "hf", dtype=torch.float32, tokenizer="default")
    for path in (step, run, step / "titanrush.json", out, out / "config.json"):
        assert hf.model_args_at(path) == args, path
    with pytest.raises(ConfigError, match="holds neither a titanrush checkpoint"):
        hf.model_args_at(tmp_path)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="does not hold a JSON object"):
        hf.model_args_at(tmp_path / "bad.json")
    # The tokenizer a checkpoint was trained with: the run's config.toml, else the shipped one; an import
    # carries its own tokenizer.json.
    assert hf.training_tokenizer(step) == hf.training_tokenizer(run) == "/somewhere/tokenizer.model"
    assert hf.training_tokenizer(out) == str((out / "tokenizer.json").resolve())
    imported = hf_convert.import_hf(out, tmp_path / "imported")
    assert hf.training_tokenizer(imported) == str((imported / "tokenizer.json").resolve())
    assert hf.training_tokenizer(hf_convert.export_hf(step, tmp_path / "bare", tokenizer=None)) == "default"
    with pytest.raises(
        ConfigError, match=r"tokenizer file '/somewhere/tokenizer.model' not found.*--tokenizer"
    ):
        hf_convert.export_hf(step, tmp_path / "hf2")  # the run's tokenizer is gone: say so, and how to pick
    assert not (tmp_path / "hf2").exists()


def test_export_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    ckpt = save_checkpoint(make_model(model_args("debug", vocab_size=4096)), tmp_path / "ck")
    with pytest.raises(ConfigError, match=r"has 8192 ids, the model's vocabulary only 4096"):
        hf_convert.export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    out = hf_convert.export_hf(ckpt, tmp_path / "hf", tokenizer=None)
    assert "eos_token_id" not in json.loads((out / "generation_config.json").read_text())


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("titanrush convert: error: "), err
    return err


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path, capsys):
    """Under a file (root may write anywhere, so that is the unwritable parent here), or over a file: one
    line, exit 2, nothing written, the file untouched."""
    ckpt = save_checkpoint(make_model(model_args("debug")), tmp_path / "ck")
    hf_dir = hf_convert.export_hf(ckpt, tmp_path / "hf", dtype=torch.float32, tokenizer=None)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = [
        (
            ["--to-hf", str(ckpt), str(a_file / "out")],
            f"{a_file} is a file, so {a_file / 'out'} cannot be made",
        ),
        (["--to-pt", str(ckpt), str(a_file / "m.pt")], f"cannot write {a_file / 'm.pt'}: {a_file} is a file"),
        (["--to-pt", str(ckpt), str(a_file / "x" / "m.pt")], f"{a_file} is a file, so {a_file / 'x'} cannot"),
        (["--from-hf", str(hf_dir), str(a_file / "imp")], f"{a_file} is a file, so {a_file / 'imp'} cannot"),
        (["--from-hf", str(hf_dir), str(a_file)], f"{a_file} exists: import to a new path"),
        (["--to-hf", str(ckpt), str(a_file)], f"{a_file} exists: export to a new path"),
    ]
    for argv, message in cases:
        assert convert.main(argv) == 2, argv
        err = one_error_line(capsys)
        assert message in err, err
        assert "choose an output path in a writable folder" in err or "to a new path" in err, err
    assert a_file.read_text() == "keep me\n" and sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("mode", ["to-hf", "to-pt", "from-hf"])
def test_a_failed_write_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, mode):
    from torch.distributed.checkpoint import filesystem

    ckpt = save_checkpoint(make_model(model_args("debug")), tmp_path / "ck")
    hf_dir = hf_convert.export_hf(ckpt, tmp_path / "hf", dtype=torch.float32, tokenizer=None)
    before = sorted(p.name for p in tmp_path.iterdir())

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if mode == "to-hf":
        monkeypatch.setattr(hf_convert, "save_safetensors", full_disk)
    elif mode == "to-pt":
        monkeypatch.setattr(torch, "save", full_disk)
    else:
        monkeypatch.setattr(filesystem, "_write_item", full_disk)  # inside DCP, which wraps the error
    out = tmp_path / "new" / "deeper" / ("m.pt" if mode == "to-pt" else "out")
    assert convert.main([f"--{mode}", str(hf_dir if mode == "from-hf" else ckpt), str(out)]) == 2
    err = one_error_line(capsys)
    assert f"cannot write {out} (No space left on device); nothing was left there" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # not even the folders made for it


@pytest.mark.parametrize(
    "change, named",
    [
        ({"rms_norm_eps": math.nan}, "rms_norm_eps = nan"),
        ({"rope_theta": math.inf}, "rope_theta = inf"),
        ({"rope_theta": 1e999}, "rope_theta = inf"),  # (json writes Infinity; 1e999 reads as it too)
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": -math.inf,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "rope_scaling.factor = -inf",
        ),
    ],
)
def test_non_finite_numbers_in_an_hf_config_are_refused(tmp_path, capsys, change, named):
    from titanrush.tools import generate

    ckpt = save_checkpoint(make_model(model_args("debug")), tmp_path / "ck")
    hf_dir = hf_convert.export_hf(ckpt, tmp_path / "hf", dtype=torch.float32, tokenizer="default")
    cfg_file = hf_dir / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **change}))
    message = f"{cfg_file} has {named}"
    assert convert.main(["--from-hf", str(hf_dir), str(tmp_path / "imp")]) == 2
    err = one_error_line(capsys)
    assert message in err and "a finite number is needed; fix the file" in err, err
    assert not (tmp_path / "imp").exists()
    assert generate.main(["--checkpoint", str(hf_dir), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    with pytest.raises(ConfigError, match=message):  # model.from_checkpoint reads it so too
        hf.model_args_at(hf_dir)


def test_non_finite_numbers_in_a_llama4_config_are_refused():
    from titanrush.models.llama4 import model_args as llama4_args

    cfg = hf.hf_config(llama4_args("llama4_debug"), torch.float32)
    hf.args_from_hf_config(cfg)  # as written: accepted
    with pytest.raises(ConfigError, match=r"x/config.json has rms_norm_eps = nan: a finite number is needed"):
        hf.args_from_hf_config({**cfg, "rms_norm_eps": math.nan}, "x/config.json")
    with pytest.raises(ConfigError, match=r"rope_theta = inf"):
        hf.args_from_hf_config({**cfg, "rope_theta": math.inf})


def test_non_finite_numbers_in_a_checkpoints_titanrush_json_are_refused(tmp_path, capsys):
    step = save_checkpoint(make_model(model_args("debug")), tmp_path / "ck")
    info_file = step / "titanrush.json"
    info = json.loads(info_file.read_text())
    info["model_args"]["norm_eps"] = math.nan
    info_file.write_text(json.dumps(info))
    message = f"{info_file} has model_args.norm_eps = nan: a finite number is needed"
    with pytest.raises(ConfigError, match=message):
        hf.model_args_at(step)
    assert convert.main(["--to-pt", str(step), str(tmp_path / "m.pt")]) == 2
    assert message in one_error_line(capsys) and not (tmp_path / "m.pt").exists()


def test_an_hf_folder_whose_tokenizer_a_run_cannot_read_is_refused_on_import(tmp_path, capsys):
    """The import copies tokenizer.json for the run that trains from it: a broken one is named now."""
    ckpt = save_checkpoint(make_model(model_args("debug")), tmp_path / "ck")
    hf_dir = hf_convert.export_hf(ckpt, tmp_path / "hf", dtype=torch.float32)
    assert convert.main(["--from-hf", str(hf_dir), str(tmp_path / "good")]) == 0  # as exported: loads
    capsys.readouterr()
    (hf_dir / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    assert convert.main(["--from-hf", str(hf_dir), str(tmp_path / "imp")]) == 2
    err = capsys.readouterr().err
    assert "is not a Hugging Face tokenizer.json" in err and "import the weights alone" in err, err
    assert "Traceback" not in err and not (tmp_path / "imp").exists()
    small_ck = save_checkpoint(make_model(model_args("debug", vocab_size=300)), tmp_path / "ck300")
    small = hf_convert.export_hf(small_ck, tmp_path / "hf300", dtype=torch.float32, tokenizer=None)
    (small / "tokenizer.json").write_bytes((tmp_path / "good" / "tokenizer.json").read_bytes())
    assert convert.main(["--from-hf", str(small), str(tmp_path / "imp")]) == 2
    assert "the model's vocabulary only 300" in capsys.readouterr().err
