"""Llama 4 weights and config <-> Hugging Face's Llama 4 text model (`Llama4ForCausalLM`, `llama4_text`).

Pure mappings (no files): `titanrush.interop.hf` reads and writes the safetensors and DCP folders. The names
map one to one, and no tensor changes its layout: Hugging Face's Llama 4 rotates consecutive pairs like
titanrush (its RoPE is a complex multiply, unlike its Llama 3's `rotate_half`), and titanrush's experts
already use its stacked layout (`x @ W`):

    layers.<i>.attention.{wq,wk,wv,wo}        model.layers.<i>.self_attn.{q,k,v,o}_proj
    layers.<i>.{attention_norm,ffn_norm}      model.layers.<i>.{input_layernorm,post_attention_layernorm}
    layers.<i>.moe.router.gate                model.layers.<i>.feed_forward.router
    layers.<i>.moe.experts.w13 / .w2          model.layers.<i>.feed_forward.experts.gate_up_proj / .down_proj
    layers.<i>.moe.shared_expert.w1/w3/w2     model.layers.<i>.feed_forward.shared_expert.gate/up/down_proj
    layers.<i>.feed_forward.w1/w3/w2          model.layers.<i>.feed_forward.gate/up/down_proj (dense layers)

The multimodal checkpoints (`Llama4ForConditionalGeneration`) hold the same text weights under
`language_model.`, which `from_hf_state_dict` strips. The routing bias (titanrush's load balance) has no
Hugging Face counterpart: `titanrush.interop.hf` keeps it in a file of its own beside an export's weights. Not
modelled by titanrush: the attention temperature tuning of the NoPE layers, which changes nothing below
position `floor_scale` (8192), so an imported model computes Hugging Face's function on sequences up to
that length.
"""

from __future__ import annotations

from typing import Any

import torch

from titanrush.config import ConfigError
from titanrush.models.llama4.args import Llama4Args
from titanrush.models.llama4.model import Llama4

_ATTN = [
    ("attention.wq", "self_attn.q_proj"),
    ("attention.wk", "self_attn.k_proj"),
    ("attention.wv", "self_attn.v_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
]
_MLP = [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]


def name_map(args: Llama4Args) -> list[tuple[str, str]]:
    """(titanrush name, Hugging Face name) of every tensor of the model (the routing bias excepted)."""
    names = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    for i in range(args.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        names += [(f"{p}{ours}.weight", f"{h}{hf}.weight") for ours, hf in _ATTN]
        if args.is_moe(i):
            names += [
                (f"{p}moe.router.gate.weight", f"{h}feed_forward.router.weight"),
                (f"{p}moe.experts.w13", f"{h}feed_forward.experts.gate_up_proj"),
                (f"{p}moe.experts.w2", f"{h}feed_forward.experts.down_proj"),
            ]
            if args.shared_expert:
                names += [
                    (f"{p}moe.shared_expert.{o}.weight", f"{h}feed_forward.shared_expert.{hf}.weight")
                    for o, hf in _MLP
                ]
        else:
            names += [(f"{p}feed_forward.{o}.weight", f"{h}feed_forward.{hf}.weight") for o, hf in _MLP]
    if not args.tie_embeddings:
        names.append(("output.weight", "lm_head.weight"))
    return names


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: Llama4Args) -> dict[str, torch.Tensor]:
    """titanrush model state dict -> Hugging Face Llama4ForCausalLM state dict."""
    names = name_map(args)
    missing = [ours for ours, _ in names if ours not in sd]
    if missing:
        raise ConfigError(f"the checkpoint lacks {', '.join(missing[:4])}: it does not hold a complete model")
    return {hf: sd[ours] for ours, hf in names}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: Llama4Args) -> dict[str, torch.Tensor]:
    """Hugging Face Llama 4 text weights -> titanrush model state dict (shapes checked against `args`);
    the routing biases start at zero (`titanrush.interop.hf_convert.import_hf` restores an export's)."""
    hf_sd = {k.removeprefix("language_model."): v for k, v in hf_sd.items()}
    names = name_map(args)
    missing = [hf for _, hf in names if hf not in hf_sd]
    if missing:
        raise ConfigError(f"the Hugging Face weights lack {', '.join(missing[:4])}; is the folder complete?")
    sd = {ours: hf_sd[hf] for ours, hf in names}
    if args.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    with torch.device("meta"):
        model = Llama4(args)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [
        f"{k} {tuple(v.shape)} (expected {shapes[k]})" for k, v in sd.items() if tuple(v.shape) != shapes[k]
    ]
    if wrong:
        raise ConfigError(f"Hugging Face tensors do not match config.json: {', '.join(wrong[:4])}")
    for i in args.moe_layers:
        sd[f"layers.{i}.moe.expert_bias"] = torch.zeros(args.n_experts)
    return sd


def hf_config(args: Llama4Args, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The `config.json` of a Hugging Face Llama4ForCausalLM with these weights
    (`titanrush.interop.hf.hf_config` adds the BOS/EOS ids)."""
    rope = None
    if args.rope_scaling:
        rope = {
            "rope_type": "llama3",
            "factor": args.rope_scale_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_len,
        }
    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "intermediate_size": args.expert_hidden,
        "intermediate_size_mlp": args.ffn_hidden,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_layers": args.moe_layers,
        "interleave_moe_layer_step": args.moe_every,
        "no_rope_layers": [int(args.uses_rope(i)) for i in range(args.n_layers)],
        "attention_chunk_size": args.attn_chunk or None,
        "use_qk_norm": args.qk_norm,
        "attn_temperature_tuning": False,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def args_from_hf_config(cfg: dict[str, Any]) -> Llama4Args:
    """Llama4Args from a Hugging Face Llama 4 config (a text config, or a multimodal one's `text_config`).

    Raises:
        ConfigError: for a layout titanrush's Llama 4 cannot hold (naming what and why).
    """
    cfg = cfg.get("text_config", cfg)
    n_layers, dim, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim", dim // heads) != dim // heads:
        raise ConfigError(f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads: not supported")
    step = cfg.get("interleave_moe_layer_step", 1)
    moe_layers = cfg.get("moe_layers") or list(range(step - 1, n_layers, step))
    if list(moe_layers) != list(range(step - 1, n_layers, step)):
        raise ConfigError(f"moe_layers {moe_layers} are not every {step}-th layer: not supported")
    no_rope = cfg.get("no_rope_layers") or []
    nope = [i for i, use in enumerate(no_rope) if not use]
    every = nope[0] + 1 if nope else 0
    if nope and nope != list(range(every - 1, n_layers, every)):
        raise ConfigError(f"the NoPE layers {nope} are not every {every}-th layer: not supported")
    rope = cfg.get("rope_scaling") or {}
    dense = cfg.get("intermediate_size_mlp", 4 * dim)
    base = int(8 * dim / 3)  # ModelArgs.ffn_hidden = int(multiplier x base) rounded up to multiple_of 1
    args = Llama4Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads", heads),
        vocab_size=cfg["vocab_size"],
        multiple_of=1,
        ffn_dim_multiplier=(dense + 0.5) / base,
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", 500000.0),
        rope_scaling=bool(rope),
        rope_scale_factor=rope.get("factor", 8.0),
        rope_low_freq_factor=rope.get("low_freq_factor", 1.0),
        rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
        rope_original_max_len=rope.get("original_max_position_embeddings", 8192),
        max_seq_len=cfg.get("max_position_embeddings", 8192),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        n_experts=cfg["num_local_experts"],
        top_k=cfg.get("num_experts_per_tok", 1),
        moe_hidden=cfg["intermediate_size"],
        moe_every=step,
        nope_every=every,
        attn_chunk=cfg.get("attention_chunk_size") or 0,
        qk_norm=bool(cfg.get("use_qk_norm", False)),
    )
    assert args.ffn_hidden == dense, (args.ffn_hidden, dense)  # the multiplier reproduces it exactly
    return args
