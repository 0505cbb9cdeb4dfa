"""Checkpoint interchange, the reading side: titanrush DCP checkpoints and Hugging Face Llama folders.

The mapping itself (names, the RoPE permutation, config.json) is `titanrush.hf_mapping` for the dense
Llama and `titanrush.models.llama4.hf` for Llama 4 (Hugging Face's `Llama4ForCausalLM`); this module
reads checkpoints and folders (their model arguments, weights and training tokenizer) and picks the
mapping by the model's arguments. The conversions that write (to a Hugging Face folder or a `.pt` file,
and back) are `titanrush.hf_convert`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titanrush import hf_mapping
from titanrush.checkpoint_compat import RUNTIME_ARGS, model_arg_differences
from titanrush.checkpoint_folder import summarize
from titanrush.checkpoint_integrity import read_record, verify
from titanrush.config import ConfigError
from titanrush.hf_mapping import first_few
from titanrush.models.llama import Llama, ModelArgs
from titanrush.models.llama.flavors import CUSTOM, SHAPE_FIELDS
from titanrush.models.llama4 import FLAVORS as LLAMA4_FLAVORS
from titanrush.models.llama4 import Llama4, Llama4Args
from titanrush.models.llama4 import hf as llama4_hf
from titanrush.safetensors_io import load_hf_weights, load_safetensors, save_safetensors

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - only where tomllib is missing
    import tomli as tomllib

__all__ = [
    "BIAS_FILE", "DTYPES", "INFO_FILE", "TOKENIZER_FILES", "args_from_hf_config", "cast_state_dict",
    "flavor_of", "from_hf_state_dict", "hf_config", "import_command", "load_hf_weights", "load_safetensors",
    "model_args_at", "read_checkpoint", "read_json", "save_safetensors", "to_hf_state_dict",
    "training_tokenizer",
]  # fmt: skip

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
INFO_FILE = "titanrush.json"
BIAS_FILE = "titanrush_expert_bias.safetensors"  # Llama 4's routing biases, beside an export's weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Conversion runs in one process without a process group on purpose; DCP warns about exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def read_json(path: Path) -> dict[str, Any]:
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
    """(the shape in titanrush.json's model_args, with the runtime fields at their defaults; the info).

    A Llama 4 checkpoint (its arguments name `n_experts`) gives Llama4Args.
    """
    info = read_json(info_file)
    hf_mapping.check_finite(info, str(info_file))
    try:
        saved = info["model_args"]
        if "n_experts" in saved:
            known = {f.name for f in dataclasses.fields(Llama4Args)} - (RUNTIME_ARGS - {"max_seq_len"})
            return Llama4Args(**{k: v for k, v in saved.items() if k in known}), info
        return ModelArgs(**{k: saved[k] for k in SHAPE_FIELDS if k in saved}), info
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{info_file} lacks model_args or holds unknown ones ({e})") from e


def args_from_hf_config(cfg: dict[str, Any], source: str | Path = "config.json") -> ModelArgs:
    """ModelArgs of a Hugging Face `config.json`: a Llama (`LlamaForCausalLM`), or Llama4Args of a Llama 4
    (`Llama4ForCausalLM`, or the text model of `Llama4ForConditionalGeneration`); ConfigError otherwise
    (source: the file, for messages)."""
    hf_mapping.check_finite(cfg, str(source))
    kinds = {cfg.get("model_type"), *cfg.get("architectures", [])}
    if kinds & {"llama4", "llama4_text", "Llama4ForCausalLM", "Llama4ForConditionalGeneration"}:
        try:
            return llama4_hf.args_from_hf_config(cfg)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
            raise ConfigError(f"{source} of a Llama 4 lacks or mistypes {type(e).__name__}: {e}") from None
    try:
        return hf_mapping.args_from_hf_config(cfg, str(source))
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:  # a mistyped value
        raise ConfigError(
            f"{source} of a Llama lacks or mistypes a value ({type(e).__name__}: {e})"
        ) from None


def flavor_of(args: ModelArgs) -> str:
    """The flavor whose model args computes (vocabulary, tying and lengths aside), else 'custom'."""
    if not isinstance(args, Llama4Args):
        return hf_mapping.flavor_of(args)
    mine = dataclasses.asdict(args)
    for name, flavor in LLAMA4_FLAVORS.items():
        same = dataclasses.replace(flavor, vocab_size=args.vocab_size, tie_embeddings=args.tie_embeddings)
        if not model_arg_differences(dataclasses.asdict(same), mine):
            return name
    return CUSTOM


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanrush model state dict -> Hugging Face state dict (Llama or Llama 4, by `args`)."""
    if isinstance(args, Llama4Args):
        return llama4_hf.to_hf_state_dict(sd, args)
    return hf_mapping.to_hf_state_dict(sd, args)


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face state dict -> titanrush model state dict (Llama or Llama 4, by `args`)."""
    if isinstance(args, Llama4Args):
        return llama4_hf.from_hf_state_dict(hf_sd, args)
    return hf_mapping.from_hf_state_dict(hf_sd, args)


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.bfloat16, bos_id: int | None = None, eos_id: int | None = None
) -> dict[str, Any]:
    """The Hugging Face `config.json` of a model with these arguments (BOS/EOS ids where known)."""
    if not isinstance(args, Llama4Args):
        return hf_mapping.hf_config(args, dtype, bos_id, eos_id)
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    return llama4_hf.hf_config(args, dtype) | {k: v for k, v in ids.items() if v is not None}


def _shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every entry of the model's state dict and its shape."""
    with torch.device("meta"):
        model = Llama4(args) if isinstance(args, Llama4Args) else Llama(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


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
        return _info_args(p)[0] if p.name == INFO_FILE else args_from_hf_config(read_json(p), p)
    if p.is_dir() and (p / "config.json").exists() and not (p / INFO_FILE).exists():
        return args_from_hf_config(read_json(p / "config.json"), p / "config.json")
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
    _verify(path)
    args, info = _info_args(path / INFO_FILE)
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise ConfigError(f"{path / '.metadata'} is unreadable ({type(e).__name__}); use another step") from e
    shapes = _shapes(args)
    if args.tie_embeddings:
        shapes.pop("output.weight")  # the embedding itself, whether stored or not
    missing = [k for k in shapes if f"model.{k}" not in stored]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks model weights {first_few(missing)}")
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
    except (Exception, dcp.CheckpointException) as e:  # (DCP's exception is a BaseException)
        raise ConfigError(
            f"checkpoint {path} is corrupt: a data file is truncated, missing or unreadable "
            f"({type(e).__name__}); use another step"
        ) from None
    return cast_state_dict(sd, sd["tok_embeddings.weight"].dtype, args.tie_embeddings), args, info


def _verify(path: Path) -> None:
    """Check the step folder's files against its integrity record, as a resume does (none: not checked)."""
    try:
        record = read_record(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: {e}; use another step") from None
    problems = verify(path, record) if record is not None else []
    if problems:
        raise ConfigError(f"checkpoint {path} is corrupt: {summarize(problems)}; use another step")


def cast_state_dict(sd: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> dict[str, torch.Tensor]:
    """sd in dtype; when tied, `output.weight` is the embedding tensor (as in `Llama.state_dict()`)."""
    out = {k: v.to(dtype) for k, v in sd.items() if not (tied and k == "output.weight")}
    if tied:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def import_command(checkpoint_dir: str | Path) -> list[str]:
    """The command-line overrides that start a run from an imported checkpoint, its shape and tokenizer."""
    out = str(checkpoint_dir)
    args, info = _info_args(Path(out) / INFO_FILE)
    if isinstance(args, Llama4Args):  # a Llama 4 flavor, with the vocabulary and tying of the weights
        flavor = LLAMA4_FLAVORS[info["flavor"]]
        flags = ["--model.flavor", info["flavor"]]
        if args.vocab_size != flavor.vocab_size:
            flags += ["--model.vocab_size", str(args.vocab_size)]
        if args.tie_embeddings != flavor.tie_embeddings:
            flags += ["--model.tie_embeddings", "tied" if args.tie_embeddings else "untied"]
    else:
        flags = ["--model.flavor", CUSTOM, "--model.from_checkpoint", out]
    flags += ["--checkpoint.load_path", out, "--checkpoint.load_model_only"]
    if (Path(out) / "tokenizer.json").exists():
        flags += ["--data.tokenizer", str(Path(out) / "tokenizer.json")]
    return flags
