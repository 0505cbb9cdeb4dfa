"""Llama 4 <-> Hugging Face's Llama 4 text model: names, config and the function the weights compute."""

from __future__ import annotations

import pytest
import torch

from titanrush.config import ConfigError
from titanrush.models.llama4 import Llama4, model_args
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
        ("llama4_17Bx16E", dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
                                num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                                intermediate_size_mlp=16384, num_local_experts=16, num_experts_per_tok=1,
                                vocab_size=202048, attention_chunk_size=8192, use_qk_norm=True,
                                rope_theta=500000.0, interleave_moe_layer_step=1)),
        ("llama4_17Bx128E", dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                                 intermediate_size_mlp=16384, num_local_experts=128, num_experts_per_tok=1,
                                 vocab_size=202048, attention_chunk_size=8192, use_qk_norm=False,
                                 rope_theta=500000.0, interleave_moe_layer_step=2)),
    ],
)  # fmt: skip
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
