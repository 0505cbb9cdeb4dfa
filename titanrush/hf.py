"""Checkpoint interchange: titanrush DCP checkpoints <-> Hugging Face Llama folders and single `.pt` files.

Names map one to one (`layers.<i>.attention.wq` <-> `model.layers.<i>.self_attn.q_proj`, ...). Only the
query and key projections change: titanrush's RoPE rotates consecutive pairs (x[2i], x[2i+1]) (Meta's
layout), HF's `rotate_half` rotates (x[i], x[i + D/2]), so each head's output rows are reordered from
interleaved pairs to halves on the way out and back on the way in. An export carries the training
tokenizer and its BOS/EOS ids, so `transformers` loads it and generates from it as it is; an import
writes a model-only checkpoint whose `model_args` a run takes with `model.from_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titanrush.config import ConfigError
from titanrush.models.llama import FLAVORS, Llama, ModelArgs
from titanrush.models.llama.flavors import CUSTOM, SHAPE_FIELDS, ffn_sizing
from titanrush.safetensors_io import load_hf_weights, load_safetensors, save_safetensors

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - only where tomllib is missing
    import tomli as tomllib

__all__ = [
    "DTYPES", "INFO_FILE", "args_from_hf_config", "export_hf", "export_pt", "flavor_of", "from_hf_state_dict",
    "hf_config", "import_hf", "load_hf_weights", "load_safetensors", "model_args_at", "read_checkpoint",
    "save_safetensors", "to_hf_state_dict", "training_tokenizer",
]  # fmt: skip

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
INFO_FILE = "titanrush.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Conversion runs in one process without a process group on purpose; DCP warns about exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


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
        raise ConfigError(f"the checkpoint lacks {_first(missing)}; it does not hold a complete model")
    return {hf: _to_halves(sd[ours], heads) if heads else sd[ours] for ours, hf, heads in _name_map(args)}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> titanrush model state dict (shapes checked against args).

    With tied embeddings `output.weight` is the embedding tensor itself, as in `Llama.state_dict()`.
    """
    names = _name_map(args)
    missing = [hf for _, hf, _ in names if hf not in hf_sd]
    if missing:
        raise ConfigError(f"the HF weights lack {_first(missing)}; is the folder complete?")
    known = {hf for _, hf, _ in names} | {"lm_head.weight"}
    extra = [k for k in hf_sd if k not in known and not k.endswith("rotary_emb.inv_freq")]
    if extra:
        raise ConfigError(f"the HF weights hold tensors titanrush's Llama has no place for: {_first(extra)}")
    sd = {ours: _to_pairs(hf_sd[hf], heads) if heads else hf_sd[hf] for ours, hf, heads in names}
    if args.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    shapes = _expected_shapes(args)
    wrong = [f"{k} {tuple(v.shape)} (expected {shapes[k]})" for k, v in sd.items() if v.shape != shapes[k]]
    if wrong:
        raise ConfigError(f"HF tensors do not match config.json: {_first(wrong)}")
    return sd


def _first(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Llama(args).state_dict().items()}


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.bfloat16, bos_id: int | None = None, eos_id: int | None = None
) -> dict[str, Any]:
    """The `config.json` of the HF LlamaForCausalLM equivalent to args (BOS/EOS ids where known)."""
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": args.rope_scale_factor,
                        "low_freq_factor": args.rope_low_freq_factor,
                        "high_freq_factor": args.rope_high_freq_factor,
                        "original_max_position_embeddings": args.rope_original_max_len}  # fmt: skip
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "hidden_act": "silu", "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": rope_scaling, "attention_bias": False,
        "tie_word_embeddings": args.tie_embeddings, "attention_dropout": 0.0, "mlp_bias": False,
        "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }  # fmt: skip
    # Without them transformers assumes BOS 1 and EOS 2, which are ordinary tokens of titanrush's BPE.
    if bos_id is not None:
        cfg["bos_token_id"] = bos_id
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
    return cfg


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of an HF Llama `config.json` (the inverse of `hf_config`); ConfigError for anything else."""
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in cfg.get("architectures", []):
        kind = f"{cfg.get('model_type')!r} ({cfg.get('architectures')})"
        raise ConfigError(f"config.json describes a {kind} model; only Llama (LlamaForCausalLM) converts")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if [k for k in required if k not in cfg]:
        raise ConfigError(f"config.json lacks {[k for k in required if k not in cfg]}")
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
    kw: dict[str, Any] = dict(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                              n_kv_heads=cfg.get("num_key_value_heads") or heads,
                              vocab_size=cfg["vocab_size"],
                              multiple_of=multiple_of, ffn_dim_multiplier=multiplier,
                              norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                              rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
                              max_seq_len=cfg.get("max_position_embeddings", 2048),
                              tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))  # fmt: skip
    if rope_type == "llama3":
        kw.update(rope_scaling=True, rope_scale_factor=float(rope["factor"]),
                  rope_low_freq_factor=float(rope["low_freq_factor"]),
                  rope_high_freq_factor=float(rope["high_freq_factor"]),
                  rope_original_max_len=int(rope["original_max_position_embeddings"]))  # fmt: skip
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable or not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _step_folder(checkpoint_dir: str | Path) -> Path:
    """The checkpoint that checkpoint_dir names: a folder with titanrush.json (a `step-<N>` folder or an
    import), or a checkpoint folder, whose newest step with a titanrush.json is taken."""
    path = Path(checkpoint_dir).expanduser()
    if not path.is_dir():
        raise ConfigError(f"checkpoint folder {path} does not exist; pass a .../checkpoint/step-<N> folder")
    if (path / INFO_FILE).exists():
        return path
    steps = [p for p in path.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / INFO_FILE).exists()]
    if not steps:
        raise ConfigError(f"{path} holds no {INFO_FILE}: pass a .../checkpoint/step-<N> folder")
    return max(steps, key=lambda p: int(p.name[5:]))


def _info_args(info_file: Path) -> tuple[ModelArgs, dict[str, Any]]:
    """(the shape in titanrush.json's model_args, with the runtime fields at their defaults; the info)."""
    info = _read_json(info_file)
    try:
        saved = info["model_args"]
        return ModelArgs(**{k: saved[k] for k in SHAPE_FIELDS if k in saved}), info
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{info_file} lacks model_args or holds unknown ones ({e})") from e


def model_args_at(path: str | Path) -> ModelArgs:
    """The model shape stored at path (the fields that say how a run computes, e.g. the attention kernel,
    at their defaults).

    Args:
        path: a titanrush checkpoint (a `step-<N>` folder, an imported checkpoint, or a checkpoint folder,
            whose newest step is taken) or its titanrush.json; or a Hugging Face Llama folder or its
            config.json.

    Raises:
        ConfigError: nothing readable there, or not a Llama.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return _info_args(p)[0] if p.name == INFO_FILE else args_from_hf_config(_read_json(p))
    if p.is_dir() and (p / "config.json").exists() and not (p / INFO_FILE).exists():
        return args_from_hf_config(_read_json(p / "config.json"))
    if p.is_dir() and not (p / INFO_FILE).exists() and not any(p.glob("step-*")):
        raise ConfigError(f"{p} holds neither a titanrush checkpoint ({INFO_FILE}) nor an HF config.json")
    return _info_args(_step_folder(p) / INFO_FILE)[0]


def training_tokenizer(checkpoint_dir: str | Path) -> str:
    """The `data.tokenizer` a checkpoint was trained with, as far as the files say.

    The tokenizer.json an import carries in the checkpoint folder; else `data.tokenizer` of the run's
    config.toml (the run folder holds `<checkpoint.folder>/step-<N>`); else "default".
    """
    path = Path(checkpoint_dir).expanduser().resolve()
    if (path / "tokenizer.json").exists():
        return str(path / "tokenizer.json")
    for folder in [path, *path.parents][:4]:
        if (folder / "config.toml").exists():
            try:
                data = tomllib.loads((folder / "config.toml").read_text())
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                continue
            spec = data.get("data", {}).get("tokenizer")
            if isinstance(spec, str):
                return spec
    return "default"


def read_checkpoint(checkpoint_dir: str | Path) -> tuple[dict[str, torch.Tensor], ModelArgs, dict[str, Any]]:
    """(model state dict, ModelArgs, titanrush.json) of a checkpoint folder, consolidated in one process.

    checkpoint_dir is a `step-<N>` folder, or a checkpoint folder whose newest complete step is taken.
    ModelArgs holds the shape (the runtime fields at their defaults).
    """
    path = _step_folder(checkpoint_dir)
    if not (path / ".metadata").exists():
        raise ConfigError(f"{path} has no DCP .metadata file: the save did not finish; use another step")
    args, info = _info_args(path / INFO_FILE)
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise ConfigError(f"{path / '.metadata'} is unreadable ({type(e).__name__}); use another step") from e
    shapes = _expected_shapes(args)
    if args.tie_embeddings:
        shapes.pop("output.weight")  # the embedding itself, whether stored or not
    missing = [k for k in shapes if f"model.{k}" not in stored]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks model weights {_first(missing)}")
    sd: dict[str, torch.Tensor] = {}
    for k, shape in shapes.items():
        meta = stored[f"model.{k}"]
        if tuple(meta.size) != shape:
            raise ConfigError(
                f"checkpoint {path}: {k} has shape {tuple(meta.size)}, {INFO_FILE} says {shape}"
            )
        sd[k] = torch.empty(shape, dtype=meta.properties.dtype)
    try:
        dcp.load({"model": sd}, checkpoint_id=str(path), no_dist=True)
    except Exception as e:  # a data file that is truncated, missing or unreadable
        raise ConfigError(f"checkpoint {path} is corrupt ({type(e).__name__}: {e})") from e
    return _cast(sd, sd["tok_embeddings.weight"].dtype, args.tie_embeddings), args, info


def _cast(sd: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> dict[str, torch.Tensor]:
    """sd in dtype; when tied, `output.weight` is the embedding tensor (as in `Llama.state_dict()`)."""
    out = {k: v.to(dtype) for k, v in sd.items() if not (tied and k == "output.weight")}
    if tied:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _write_folder(out: Path, files: dict[str, Callable[[Path], object]]) -> None:
    """Write each file under a temporary name, then rename them all: a failure leaves nothing behind."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = {name: out / f".{name}.tmp-{os.getpid()}" for name in files}
    try:
        for name, write in files.items():
            write(tmp[name])
    except BaseException:
        for p in tmp.values():
            p.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    for name in files:
        os.replace(tmp[name], out / name)


def _text(content: str) -> Callable[[Path], object]:
    return lambda p: p.write_text(content)


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: str | None = "auto",
) -> Path:
    """Write an HF LlamaForCausalLM folder into out_dir; files of other names there are kept.

    Args:
        checkpoint_dir: a `step-<N>` folder or a checkpoint folder (its newest step).
        out_dir: the HF folder: model.safetensors, config.json, generation_config.json and, with a
            tokenizer, tokenizer.json, tokenizer_config.json and special_tokens_map.json.
        dtype: the weights' dtype.
        tokenizer: `data.tokenizer`'s syntax; "auto" takes the one the checkpoint was trained with
            (`training_tokenizer`); None writes no tokenizer (and no BOS/EOS ids).
    """
    spec = training_tokenizer(checkpoint_dir) if tokenizer == "auto" else tokenizer
    sd, args, info = read_checkpoint(checkpoint_dir)
    files: dict[str, Callable[[Path], object]] = {}
    bos = eos = None
    if spec is not None:
        from titanrush.data.hf_tokenizer import tokenizer_files  # (the data layer: only when exporting)

        try:
            tok_files, tok = tokenizer_files(spec, args.max_seq_len)
        except ConfigError as e:
            raise ConfigError(f"{e} (choose the tokenizer with --tokenizer, or --tokenizer none)") from e
        if tok.n_words > args.vocab_size:
            raise ConfigError(
                f"tokenizer {spec!r} has {tok.n_words} ids, the model's vocabulary only {args.vocab_size}: "
                "pass the tokenizer it was trained with (--tokenizer), or --tokenizer none"
            )
        bos, eos = tok.bos_id, tok.eos_id
        files.update({name: _text(content) for name, content in tok_files.items()})
    hf_sd = {k: v.to(dtype) for k, v in to_hf_state_dict(sd, args).items()}
    del sd
    meta = {"format": "pt", "titanrush_step": str(info.get("step"))}
    generation: dict[str, Any] = {"_from_model_config": True}
    if spec is not None:
        generation.update(bos_token_id=bos, eos_token_id=eos)
    files = {
        "model.safetensors": lambda p: save_safetensors(hf_sd, p, meta),
        "config.json": _text(json.dumps(hf_config(args, dtype, bos, eos), indent=2) + "\n"),
        "generation_config.json": _text(json.dumps(generation, indent=2) + "\n"),
        **files,
    }
    out = Path(out_dir)
    _write_folder(out, files)
    return out


def export_pt(checkpoint_dir: str | Path, out_path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Save {"model": state dict, "model_args": dict, "step": N} as one `.pt` file (torch.load-able)."""
    sd, args, info = read_checkpoint(checkpoint_dir)
    blob = {"model": _cast(sd, dtype, args.tie_embeddings), "model_args": dataclasses.asdict(args),
            "step": info.get("step"), "flavor": info.get("flavor")}  # fmt: skip
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(blob, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def import_hf(hf_dir: str | Path, out_checkpoint_dir: str | Path) -> Path:
    """Write an HF Llama folder as a model-only float32 DCP checkpoint + titanrush.json (+ its tokenizer).

    titanrush.json records `flavor = "custom"` and the model's arguments; train from it in one command
    with `model.flavor = "custom"`, `model.from_checkpoint = <out>`, `checkpoint.load_path = <out>` and
    `checkpoint.load_model_only` (`import_command`). The HF folder's tokenizer files, where it has them,
    are copied beside the weights (`data.tokenizer = <out>/tokenizer.json`).
    """
    src, out = Path(hf_dir), Path(out_checkpoint_dir)
    if not (src / "config.json").exists():
        raise ConfigError(f"{src / 'config.json'} not found; pass an HF model folder (config.json + weights)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; remove it or choose another output folder")
    args = args_from_hf_config(_read_json(src / "config.json"))
    sd = _cast(from_hf_state_dict(load_hf_weights(src), args), torch.float32, args.tie_embeddings)
    # "custom": the run takes this shape from model_args (model.from_checkpoint), whatever flavor it
    # resembles; `architecture` names that flavor for the reader.
    info = {"step": 0, "flavor": CUSTOM, "architecture": flavor_of(args),
            "model_args": dataclasses.asdict(args), "model_only": True, "dtype": "float32",
            "source": str(src.resolve())}  # fmt: skip
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copyfile(src / name, tmp / name)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def import_command(checkpoint_dir: str | Path) -> list[str]:
    """The command-line overrides that start a run from an imported checkpoint, its shape and tokenizer."""
    out = str(checkpoint_dir)
    flags = ["--model.flavor", CUSTOM, "--model.from_checkpoint", out, "--checkpoint.load_path", out,
             "--checkpoint.load_model_only"]  # fmt: skip
    if (Path(out) / "tokenizer.json").exists():
        flags += ["--data.tokenizer", str(Path(out) / "tokenizer.json")]
    return flags
