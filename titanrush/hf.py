"""Checkpoint interchange: titanrush DCP checkpoints <-> Hugging Face Llama folders and single `.pt` files.

Names map one to one (`layers.<i>.attention.wq` <-> `model.layers.<i>.self_attn.q_proj`, ...). Only the
query and key projections change: titanrush's RoPE rotates consecutive pairs (x[2i], x[2i+1]) (Meta's
layout), HF's `rotate_half` rotates (x[i], x[i + D/2]), so each head's output rows are reordered from
interleaved pairs to halves on the way out and back on the way in. safetensors is read and written here,
by hand: an 8-byte little-endian header length, a JSON header, then the raw little-endian bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titanrush.config import ConfigError
from titanrush.models.llama import FLAVORS, Llama, ModelArgs

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
INFO_FILE = "titanrush.json"
# Conversion runs in one process without a process group on purpose; DCP warns about exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
# Fields that do not change the weights' layout or the function the model computes.
_RUNTIME_FIELDS = (
    "attn_backend",
    "expand_kv",
    "loss_chunk_size",
    "compile_loss",
    "max_seq_len",
    "rope_positions",
    "vocab_size",
    "tie_embeddings",
)


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write tensors to one safetensors file (tensors laid out back to back in the given order)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data then starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(memoryview(_bytes_view(t.detach().cpu().contiguous()).numpy()))


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file into CPU memory."""
    size = os.path.getsize(path)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= size - 8:
            raise ConfigError(f"{path} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConfigError(f"{path} is not a safetensors file (its header is not JSON: {e})") from e
        header.pop("__metadata__", None)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] not in _ST_DTYPES:
                raise ConfigError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            t = torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            if end - start != t.numel() * t.element_size() or 8 + n + end > size:
                raise ConfigError(f"{path}: tensor {name} has inconsistent offsets (truncated file?)")
            f.seek(8 + n + start)
            f.readinto(memoryview(_bytes_view(t).numpy()))
            out[name] = t
    return out


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 view (little-endian on every supported host)."""
    return t.reshape(-1).view(torch.uint8)


def load_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model folder: one or several (indexed) safetensors or pytorch_model.bin files."""
    hf_dir = Path(hf_dir)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (hf_dir / index_name).exists():
            files = sorted(set(json.loads((hf_dir / index_name).read_text())["weight_map"].values()))
            break
    else:
        files = [n for n in ("model.safetensors", "pytorch_model.bin") if (hf_dir / n).exists()][:1]
    if not files:
        raise ConfigError(f"{hf_dir} holds no model.safetensors(.index.json) or pytorch_model.bin")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if not (hf_dir / name).exists():
            raise ConfigError(f"{hf_dir / name} is listed in the index but missing; download it again")
        if name.endswith(".safetensors"):
            out.update(load_safetensors(hf_dir / name))
        else:
            out.update(torch.load(hf_dir / name, map_location="cpu", weights_only=True))
    return out


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


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The `config.json` of the HF LlamaForCausalLM equivalent to args."""
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": args.rope_scale_factor,
                        "low_freq_factor": args.rope_low_freq_factor,
                        "high_freq_factor": args.rope_high_freq_factor,
                        "original_max_position_embeddings": args.rope_original_max_len}  # fmt: skip
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "hidden_act": "silu", "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": rope_scaling, "attention_bias": False,
        "tie_word_embeddings": args.tie_embeddings, "attention_dropout": 0.0, "mlp_bias": False,
        "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }  # fmt: skip


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
    multiple_of, multiplier = _ffn_sizing(dim, cfg["intermediate_size"])
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


def _ffn_sizing(dim: int, hidden: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) that make ModelArgs.ffn_hidden == hidden: a flavor's if one fits."""
    base = int(8 * dim / 3)
    candidates = [(a.multiple_of, a.ffn_dim_multiplier) for a in FLAVORS.values() if a.dim == dim]
    for multiple_of in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        if hidden % multiple_of == 0:
            candidates += [(multiple_of, None)] + [
                (multiple_of, round(hidden / base, d)) for d in range(1, 5)
            ]
    # multiple_of = hidden rounds any 0 < int(multiplier * base) <= hidden up to exactly hidden.
    candidates.append((hidden, None if base <= hidden else hidden / base))
    for multiple_of, mult in candidates:
        if ModelArgs(dim=dim, multiple_of=multiple_of, ffn_dim_multiplier=mult).ffn_hidden == hidden:
            return multiple_of, mult
    raise AssertionError(f"no ffn sizing for dim={dim}, hidden={hidden}")  # unreachable: the last one fits


def flavor_of(args: ModelArgs) -> str:
    """The flavor that computes the same function as args (vocab, tying and lengths aside), else 'custom'."""
    skip = {*_RUNTIME_FIELDS, "n_kv_heads", "multiple_of", "ffn_dim_multiplier"}

    def key(a: ModelArgs) -> tuple[Any, ...]:
        rest = (getattr(a, f.name) for f in dataclasses.fields(a) if f.name not in skip)
        return (a.kv_heads, a.ffn_hidden, *rest)

    return next((name for name, flavor in FLAVORS.items() if key(flavor) == key(args)), "custom")


def read_checkpoint(checkpoint_dir: str | Path) -> tuple[dict[str, torch.Tensor], ModelArgs, dict[str, Any]]:
    """(model state dict, ModelArgs, titanrush.json) of a checkpoint folder, consolidated in one process.

    checkpoint_dir is a `step-<N>` folder, or a checkpoint folder whose newest complete step is taken.
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise ConfigError(f"checkpoint folder {path} does not exist; pass a .../checkpoint/step-<N> folder")
    if not (path / INFO_FILE).exists():
        steps = [
            p for p in path.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / INFO_FILE).exists()
        ]
        if not steps:
            raise ConfigError(f"{path} holds no {INFO_FILE}: pass a .../checkpoint/step-<N> folder")
        path = max(steps, key=lambda p: int(p.name[5:]))
    if not (path / ".metadata").exists():
        raise ConfigError(f"{path} has no DCP .metadata file: the save did not finish; use another step")
    try:
        info = json.loads((path / INFO_FILE).read_text())
        fields = {f.name for f in dataclasses.fields(ModelArgs)}
        args = ModelArgs(**{k: v for k, v in info["model_args"].items() if k in fields})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path / INFO_FILE} is unreadable or lacks model_args ({e})") from e
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


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write an HF LlamaForCausalLM (model.safetensors, config.json) into out_dir; other files are kept."""
    sd, args, info = read_checkpoint(checkpoint_dir)
    hf_sd = {k: v.to(dtype) for k, v in to_hf_state_dict(sd, args).items()}
    del sd
    out, meta = Path(out_dir), {"format": "pt", "titanrush_step": str(info.get("step"))}
    files: dict[str, Callable[[Path], object]] = {
        "model.safetensors": lambda p: save_safetensors(hf_sd, p, meta),
        "config.json": lambda p: p.write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n"),
        "generation_config.json": lambda p: p.write_text('{"_from_model_config": true}\n'),
    }
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
    """Write an HF Llama folder as a model-only float32 DCP checkpoint + titanrush.json.

    Train from it with `checkpoint.load_path = <out>` and `checkpoint.load_model_only = true`, using the
    model.flavor that titanrush.json names.
    """
    src, out = Path(hf_dir), Path(out_checkpoint_dir)
    if not (src / "config.json").exists():
        raise ConfigError(f"{src / 'config.json'} not found; pass an HF model folder (config.json + weights)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; remove it or choose another output folder")
    try:
        cfg = json.loads((src / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{src / 'config.json'} is not valid JSON ({e})") from e
    args = args_from_hf_config(cfg)
    sd = _cast(from_hf_state_dict(load_hf_weights(src), args), torch.float32, args.tie_embeddings)
    info = {"step": 0, "flavor": flavor_of(args), "model_args": dataclasses.asdict(args), "model_only": True,
            "dtype": "float32", "source": str(src.resolve())}  # fmt: skip
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
