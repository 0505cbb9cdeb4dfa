"""titanrush's Llama <-> Hugging Face's LlamaForCausalLM: tensor names, the RoPE permutation, config.json.

Names map one to one (`layers.<i>.attention.wq` <-> `model.layers.<i>.self_attn.q_proj`, ...). Only the
query and key projections change: titanrush's RoPE rotates consecutive pairs (x[2i], x[2i+1]) (Meta's
layout), HF's `rotate_half` rotates (x[i], x[i + D/2]), so each head's output rows are reordered from
interleaved pairs to halves on the way out and back on the way in. `titanrush.interop.hf` reads and writes the
files.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from titanrush.config import ConfigError
from titanrush.models.llama import FLAVORS, Llama, ModelArgs
from titanrush.models.llama.flavors import CUSTOM, SHAPE_FIELDS, ffn_sizing


def _to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, reorder output rows from interleaved pairs (2i, 2i+1) to halves (i, i + D/2)."""
    return w.unflatten(0, (heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def _to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_to_halves`."""
    return w.unflatten(0, (heads, 2, -1)).transpose(1, 2).reshape(w.shape)


def _name_map(args: ModelArgs) -> list[tuple[str, str, int]]:
    """(titanrush name, HF name, heads to permute or 0) for every stored tensor (no lm_head when tied)."""
    names = [
        ("tok_embeddings.weight", "model.embed_tokens.weight", 0),
        ("norm.weight", "model.norm.weight", 0),
    ]
    for i in range(args.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        names += [
            (p + "attention.wq.weight", h + "self_attn.q_proj.weight", args.n_heads),
            (p + "attention.wk.weight", h + "self_attn.k_proj.weight", args.kv_heads),
            (p + "attention.wv.weight", h + "self_attn.v_proj.weight", 0),
            (p + "attention.wo.weight", h + "self_attn.o_proj.weight", 0),
            (p + "feed_forward.w1.weight", h + "mlp.gate_proj.weight", 0),
            (p + "feed_forward.w3.weight", h + "mlp.up_proj.weight", 0),
            (p + "feed_forward.w2.weight", h + "mlp.down_proj.weight", 0),
            (p + "attention_norm.weight", h + "input_layernorm.weight", 0),
            (p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 0),
        ]
    if not args.tie_embeddings:
        names.append(("output.weight", "lm_head.weight", 0))
    return names


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanrush model state dict (parameter names, no `model.` prefix) -> HF LlamaForCausalLM state dict."""
    missing = [ours for ours, _, _ in _name_map(args) if ours not in sd]
    if missing:
        raise ConfigError(f"the checkpoint lacks {first_few(missing)}; it does not hold a complete model")
    return {hf: _to_halves(sd[ours], heads) if heads else sd[ours] for ours, hf, heads in _name_map(args)}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> titanrush model state dict (shapes checked against args).

    With tied embeddings `output.weight` is the embedding tensor itself, as in `Llama.state_dict()`.
    """
    names = _name_map(args)
    missing = [hf for _, hf, _ in names if hf not in hf_sd]
    if missing:
        raise ConfigError(f"the HF weights lack {first_few(missing)}; is the folder complete?")
    known = {hf for _, hf, _ in names} | {"lm_head.weight"}
    extra = [k for k in hf_sd if k not in known and not k.endswith("rotary_emb.inv_freq")]
    if extra:
        raise ConfigError(
            f"the HF weights hold tensors titanrush's Llama has no place for: {first_few(extra)}"
        )
    sd = {ours: _to_pairs(hf_sd[hf], heads) if heads else hf_sd[hf] for ours, hf, heads in names}
    if args.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    shapes = expected_shapes(args)
    wrong = [f"{k} {tuple(v.shape)} (expected {shapes[k]})" for k, v in sd.items() if v.shape != shapes[k]]
    if wrong:
        raise ConfigError(f"HF tensors do not match config.json: {first_few(wrong)}")
    return sd


def first_few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Llama(args).state_dict().items()}


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.bfloat16, bos_id: int | None = None, eos_id: int | None = None
) -> dict[str, Any]:
    """The `config.json` of the HF LlamaForCausalLM equivalent to args (BOS/EOS ids where known)."""
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scale_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_len,
        }
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    # Without them transformers assumes BOS 1 and EOS 2, which are ordinary tokens of titanrush's BPE.
    if bos_id is not None:
        cfg["bos_token_id"] = bos_id
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
    return cfg


def nonfinite(value: Any, name: str = "") -> list[tuple[str, float]]:
    """(dotted name, value) of every NaN or infinite number in a JSON value (Python's json reads `NaN`,
    `Infinity` and `1e999`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [(name, value)]
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in nonfinite(v, f"{name}.{k}" if name else str(k))]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in nonfinite(v, f"{name}[{i}]")]
    return []


def check_finite(cfg: dict[str, Any], source: str = "config.json") -> None:
    """Refuse a JSON config holding NaN or an infinity (as `rms_norm_eps` or `rope_theta`, it would make
    every activation NaN); source names the file in the message."""
    bad = nonfinite(cfg)
    if bad:
        more = f" (and {', '.join(k for k, _ in bad[1:])})" if bad[1:] else ""
        raise ConfigError(
            f"{source} has {bad[0][0]} = {bad[0][1]}{more}: a finite number is needed; fix the file"
        )


def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """ModelArgs of an HF Llama `config.json` (the inverse of `hf_config`); ConfigError for anything else
    (source: the file, for messages)."""
    check_finite(cfg, source)
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in cfg.get("architectures", []):
        kind = f"{cfg.get('model_type')!r} ({cfg.get('architectures')})"
        raise ConfigError(f"config.json describes a {kind} model; only Llama (LlamaForCausalLM) converts")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if [k for k in required if k not in cfg]:
        raise ConfigError(f"config.json lacks {[k for k in required if k not in cfg]}")
    counts = (*required, "num_key_value_heads", "max_position_embeddings")
    for k in counts:
        value = cfg.get(k, 1)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"config.json has {k} = {value!r}: a whole number >= 1 is needed")
    unsupported = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for key, want in unsupported.items():
        if cfg.get(key, want) != want:
            raise ConfigError(f"config.json has {key} = {cfg[key]!r}; titanrush supports only {want!r}")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // heads):
        raise ConfigError(f"config.json has head_dim {cfg['head_dim']} != hidden_size / num_attention_heads")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"config.json has rope type {rope_type!r}; titanrush supports default and llama3")
    multiple_of, multiplier = ffn_sizing(dim, cfg["intermediate_size"])
    kw: dict[str, Any] = dict(
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg["vocab_size"],
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if rope_type == "llama3":
        kw.update(
            rope_scaling=True,
            rope_scale_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
        )
    return ModelArgs(**kw)


def flavor_of(args: ModelArgs) -> str:
    """The flavor that computes the same function as args (vocab, tying and lengths aside), else 'custom'."""
    # n_kv_heads, multiple_of and ffn_dim_multiplier are compared through kv_heads and ffn_hidden
    ignore = {
        "vocab_size",
        "tie_embeddings",
        "max_seq_len",
        "n_kv_heads",
        "multiple_of",
        "ffn_dim_multiplier",
    }

    def key(a: ModelArgs) -> tuple[Any, ...]:
        return (a.kv_heads, a.ffn_hidden, *(getattr(a, f) for f in SHAPE_FIELDS if f not in ignore))

    return next((name for name, flavor in FLAVORS.items() if key(flavor) == key(args)), CUSTOM)
