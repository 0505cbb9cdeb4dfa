"""Llama 4 <-> Hugging Face's Llama 4 text model: names, config and the function the weights compute."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from titanrush.config import ConfigError
from titanrush.interop import hf_convert
from titanrush.models.llama4 import Llama4, Llama4Args, model_args
from titanrush.models.llama4.hf import args_from_hf_config, from_hf_state_dict, hf_config, to_hf_state_dict


def _model(**over: object) -> Llama4:
    args = model_args("llama4_debug", moe_every=2, nope_every=2, attn_chunk=16, qk_norm=True, **over)
    model = Llama4(args)
    model.init_weights(seed=5)
    return model


def test_export_then_import_computes_the_same_function():
    """Weights and config out to Hugging Face's names and back: a model built from the imported config
    and loaded with the imported weights gives the same logits (dense and MoE layers, NoPE and chunked
    attention, QK-norm)."""
    model = _model()
    hf = to_hf_state_dict(model.state_dict(), model.args)
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in hf  # layer 1: MoE
    assert "model.layers.0.feed_forward.gate_proj.weight" in hf  # layer 0: dense
    assert not any("expert_bias" in k for k in hf)  # titanrush's load balance: not Hugging Face's
    cfg = hf_config(model.args)
    args = args_from_hf_config({"text_config": cfg})  # (as nested in a multimodal config)
    back = Llama4(args)
    back.load_state_dict(from_hf_state_dict({f"language_model.{k}": v for k, v in hf.items()}, args))
    tokens = torch.randint(0, args.vocab_size, (2, 48))
    torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=0)
    for field in ("ffn_hidden", "expert_hidden", "moe_layers", "attn_chunk", "qk_norm", "n_experts"):
        assert getattr(args, field) == getattr(model.args, field), field
    assert [args.uses_rope(i) for i in range(4)] == [True, False, True, False]


@pytest.mark.parametrize(
    "flavor, published",
    [  # Meta's published Llama 4 text configs (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E)
        (
            "llama4_17Bx16E",
            dict(
                hidden_size=5120,
                num_hidden_layers=48,
                num_attention_heads=40,
                num_key_value_heads=8,
                head_dim=128,
                intermediate_size=8192,
                intermediate_size_mlp=16384,
                num_local_experts=16,
                num_experts_per_tok=1,
                vocab_size=202048,
                attention_chunk_size=8192,
                use_qk_norm=True,
                rope_theta=500000.0,
                interleave_moe_layer_step=1,
            ),
        ),
        (
            "llama4_17Bx128E",
            dict(
                hidden_size=5120,
                num_hidden_layers=48,
                num_attention_heads=40,
                num_key_value_heads=8,
                head_dim=128,
                intermediate_size=8192,
                intermediate_size_mlp=16384,
                num_local_experts=128,
                num_experts_per_tok=1,
                vocab_size=202048,
                attention_chunk_size=8192,
                use_qk_norm=False,
                rope_theta=500000.0,
                interleave_moe_layer_step=2,
            ),
        ),
    ],
)
def test_published_shapes_match_metas_configs(flavor, published):
    cfg = hf_config(model_args(flavor))
    assert {k: cfg[k] for k in published} == published
    assert cfg["no_rope_layers"][:8] == [1, 1, 1, 0, 1, 1, 1, 0]
    if flavor == "llama4_17Bx16E":
        assert cfg["rope_scaling"]["factor"] == 16.0 and cfg["moe_layers"] == list(range(48))
    else:
        assert cfg["rope_scaling"] is None and cfg["moe_layers"] == list(range(1, 48, 2))


def test_incomplete_or_mismatched_weights_are_named():
    model = _model()
    hf = to_hf_state_dict(model.state_dict(), model.args)
    del hf["model.layers.3.feed_forward.router.weight"]
    with pytest.raises(ConfigError, match="lack model.layers.3.feed_forward.router.weight"):
        from_hf_state_dict(hf, model.args)
    hf = to_hf_state_dict(model.state_dict(), model.args)
    with pytest.raises(ConfigError, match="do not match config.json"):
        from_hf_state_dict(hf, model_args("llama4_debug", moe_every=2, nope_every=2, n_experts=4))
    with pytest.raises(ConfigError, match="not every 2-th layer"):
        args_from_hf_config({**hf_config(model.args), "moe_layers": [1, 2]})


@pytest.mark.parametrize("top_k, tied", [(1, False), (2, True)], ids=["top1_untied", "top2_tied"])
def test_transformers_llama4_gives_titanrush_logits(tmp_path, top_k, tied):
    """transformers' own Llama4ForCausalLM, loaded from titanrush's export, computes titanrush's logits:
    dense and MoE layers, NoPE layers, chunked attention, QK-norm, top-k sigmoid routing (fp32)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: it is in [dev]")
    from titanrush.interop import hf as interchange
    from titanrush.interop.safetensors_io import save_safetensors

    model = _model(top_k=top_k, tie_embeddings=tied, attn_backend="math")
    save_safetensors(
        interchange.to_hf_state_dict(model.state_dict(), model.args), tmp_path / "model.safetensors"
    )
    cfg = interchange.hf_config(model.args, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.Llama4ForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens = torch.randint(0, model.args.vocab_size, (2, 48))  # three attention chunks of 16
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=0, atol=2e-5)


def test_a_trained_llama4_checkpoint_goes_to_hugging_face_and_back_into_a_run(tmp_path, capsys):
    """`convert --to-hf` of a Llama 4 run's checkpoint, `--from-hf` of that folder, and the command the
    import prints trains on from the same weights (its flavor found from the shape). The routing biases,
    which Hugging Face's Llama 4 has no place for, travel in a file of their own, and the export says so."""
    from titanrush import config
    from titanrush.interop import hf as interchange
    from titanrush.run.plan import build_plan
    from titanrush.tools import convert
    from titanrush.trainer import Trainer

    def train(name: str, steps: int, *extra: str) -> Path:
        argv = [
            "--model.flavor",
            "llama4_debug",
            "--job.dump_folder",
            str(tmp_path),
            "--job.name",
            name,
            "--training.steps",
            str(steps),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--metrics.log_freq",
            "1",
            *extra,
        ]
        cfg = config.load(None, argv)
        trainer = Trainer(cfg, build_plan(cfg, 1))
        try:
            trainer.train()
        finally:
            trainer.close()
        return tmp_path / name

    run = train(
        "run", 2, "--checkpoint.enable", "--checkpoint.interval", "2", "--moe.bias_update_rate", "0.01"
    )
    assert convert.main(["--to-hf", str(run / "checkpoint"), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Llama4ForCausalLM"] and "bos_token_id" in cfg
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    assert (
        tmp_path / "hf" / interchange.BIAS_FILE
    ).exists() and "routes by learned biases" in capsys.readouterr().out
    assert convert.main(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    saved, _, _ = interchange.read_checkpoint(run / "checkpoint")
    back, args, info = interchange.read_checkpoint(tmp_path / "imported")
    assert info["flavor"] == "llama4_debug" and isinstance(args, Llama4Args)
    biases = [k for k in saved if k.endswith("expert_bias")]
    assert biases and any(saved[k].abs().sum() > 0 for k in biases)  # (moved in training)
    assert sorted(back) == sorted(saved)
    for k in saved:
        assert torch.equal(back[k], saved[k]), k
    flags = interchange.import_command(tmp_path / "imported")
    assert flags[:2] == ["--model.flavor", "llama4_debug"] and "--model.from_checkpoint" not in flags
    rows = [
        json.loads(x) for x in (train("resumed", 1, *flags[2:]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss" in r] == [1] and math.isfinite(rows[-1]["loss"])


def test_a_llama4_shape_that_is_no_flavor_is_refused_on_import_and_generate_refuses_llama4(tmp_path):
    from titanrush.interop import hf as interchange
    from titanrush.interop.safetensors_io import save_safetensors
    from titanrush.tools import generate

    model = _model(n_experts=4)  # llama4_debug has 8
    save_safetensors(
        interchange.to_hf_state_dict(model.state_dict(), model.args), tmp_path / "model.safetensors"
    )
    (tmp_path / "config.json").write_text(json.dumps(interchange.hf_config(model.args)))
    with pytest.raises(ConfigError, match="none of titanrush's Llama 4 flavors"):
        hf_convert.import_hf(tmp_path, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()
    with pytest.raises(ConfigError, match="generate takes dense Llamas only"):
        generate.load_model(tmp_path, torch.device("cpu"), torch.float32, 64)


def test_an_import_of_another_vocabulary_and_tying_names_them_and_the_run_takes_them(tmp_path):
    import dataclasses

    from titanrush import config
    from titanrush.checkpoint.compat import model_arg_differences
    from titanrush.interop import hf as interchange
    from titanrush.interop.safetensors_io import save_safetensors
    from titanrush.run.plan import build_plan

    model = Llama4(model_args("llama4_debug", vocab_size=9000, tie_embeddings=True))
    model.init_weights(seed=1)
    hf_sd = interchange.to_hf_state_dict(model.state_dict(), model.args)
    save_safetensors(hf_sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(interchange.hf_config(model.args)))
    flags = interchange.import_command(hf_convert.import_hf(tmp_path, tmp_path / "imported"))
    want = ["--model.flavor", "llama4_debug", "--model.vocab_size", "9000", "--model.tie_embeddings", "tied"]
    assert flags[:6] == want
    _, saved, _ = interchange.read_checkpoint(tmp_path / "imported")
    plan = build_plan(config.load(None, flags), 1, machine=False)
    assert model_arg_differences(dataclasses.asdict(saved), dataclasses.asdict(plan.args)) == []
