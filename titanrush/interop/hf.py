"""Checkpoint interchange, the reading side: titanrush DCP checkpoints and Hugging Face Llama folders.

The mapping itself (names, the RoPE permutation, config.json) is `titanrush.interop.hf_mapping` for the dense
Llama and `titanrush.models.llama4.hf` for Llama 4 (Hugging Face's `Llama4ForCausalLM`); this module
reads checkpoints and folders (their model arguments, weights and training tokenizer) and picks the
mapping by the model's arguments. The conversions that write (to a Hugging Face folder or a `.pt` file,
and back) are `titanrush.interop.hf_convert`.
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

from titanrush.checkpoint.compat import RUNTIME_ARGS, model_arg_differences
from titanrush.checkpoint.folder import data_problems, read_info, summarize
from titanrush.checkpoint.integrity import read_record, verify
from titanrush.config import ConfigError
from titanrush.files import first_unreadable, unreadable_message
from titanrush.interop import hf_mapping
from titanrush.interop.hf_mapping import first_few
from titanrush.interop.pruned import CheckpointRemoved, newest_kept, reading
from titanrush.interop.safetensors_io import load_hf_weights, load_safetensors, save_safetensors
from titanrush.models.llama import Llama, ModelArgs
from titanrush.models.llama.flavors import CUSTOM, SHAPE_FIELDS
from titanrush.models.llama4 import FLAVORS as LLAMA4_FLAVORS
from titanrush.models.llama4 import Llama4, Llama4Args
from titanrush.models.llama4 import hf as llama4_hf

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - only where tomllib is missing
    import tomli as tomllib

__all__ = [
    "BIAS_FILE",
    "DTYPES",
    "INFO_FILE",
    "TOKENIZER_FILES",
    "args_from_hf_config",
    "cast_state_dict",
    "flavor_of",
    "from_hf_state_dict",
    "hf_config",
    "hf_folder",
    "import_command",
    "is_hf_folder",
    "load_hf_weights",
    "load_safetensors",
    "model_args_at",
    "read_checkpoint",
    "read_json",
    "save_safetensors",
    "to_hf_state_dict",
    "training_tokenizer",
    "weights_folder",
    "wrong_path",
]

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}
INFO_FILE = "titanrush.json"
_STEP = re.compile(r"step-\d+")  # a checkpoint's folder name
BIAS_FILE = "titanrush_expert_bias.safetensors"  # Llama 4's routing biases, beside an export's weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Conversion runs in one process without a process group on purpose; DCP warns about exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in path (a config.json, a titanrush.json); ConfigError naming the file otherwise."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))  # (a byte-order mark allowed)
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # (UnicodeDecodeError included)
        raise ConfigError(f"{path} is truncated or not valid JSON ({e}); fix or replace the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _step_folder(checkpoint_dir: str | Path, want: str = "checkpoint") -> Path:
    """The checkpoint that checkpoint_dir names: a folder with titanrush.json (a `step-<N>` folder or an
    import), or a checkpoint folder, whose newest step with a titanrush.json is taken; else the error of
    `wrong_path` (want: what the caller also accepts, for its message)."""
    path = Path(checkpoint_dir).expanduser()
    if path.is_dir() and (path / INFO_FILE).exists():
        return path
    steps = _steps(path)
    if not steps:
        raise wrong_path(path, want)
    return steps[-1]


def _steps(folder: Path) -> list[Path]:
    """folder's `step-<N>` folders that hold a titanrush.json, oldest first."""
    try:
        found = [p for p in folder.glob("step-*") if _STEP.fullmatch(p.name) and (p / INFO_FILE).exists()]
    except OSError:  # (a folder that cannot be listed)
        return []
    return sorted(found, key=lambda p: int(p.name[5:]))


def is_hf_folder(path: Path) -> bool:
    """Whether path is a Hugging Face model folder: a config.json and no titanrush.json."""
    return path.is_dir() and (path / "config.json").exists() and not (path / INFO_FILE).exists()


def wrong_path(path: Path, want: str) -> ConfigError:
    """The one-line error for a path that is not what a command reads: what it is, and what to pass instead.

    Args:
        path: what was given.
        want: "checkpoint" (a titanrush checkpoint), "hf" (a Hugging Face model folder) or "either".
    """
    ckpt = "a titanrush checkpoint (a .../checkpoint/step-<N> folder)"
    wanted = {
        "checkpoint": ckpt,
        "hf": "a Hugging Face model folder (config.json + weights)",
        "either": f"{ckpt} or a Hugging Face model folder",
    }[want]
    if not path.exists():
        return ConfigError(f"{path} does not exist; pass {wanted}")
    if not path.is_dir():
        parent = path.parent
        holds_it = (parent / INFO_FILE).exists() if want != "hf" else False
        if holds_it or (want != "checkpoint" and is_hf_folder(parent)):
            return ConfigError(f"{path} is a file, not a folder: pass the folder that holds it, {parent}")
        if path.suffix in (".pt", ".pth"):
            if want != "hf":
                wanted = "the checkpoint it was exported from (a .../checkpoint/step-<N> folder)" + (
                    " or a Hugging Face model folder" if want == "either" else ""
                )
            return ConfigError(f"{path} is a .pt file, which only torch.load reads: pass {wanted}")
        return ConfigError(f"{path} is a file, not a folder: pass {wanted}")
    if want == "checkpoint" and is_hf_folder(path):
        return ConfigError(
            f"{path} is a Hugging Face model folder, not a titanrush checkpoint: import it first "
            f"(titanrush convert --from-hf {path} OUT_DIR) and pass OUT_DIR"
        )
    try:
        runs = [(d, steps) for d in sorted(path.iterdir()) if d.is_dir() and (steps := _steps(d))]
    except OSError as e:
        return ConfigError(f"{path} cannot be read ({e.strerror or e}); pass {wanted}")
    inside = _steps(path)
    if want == "hf" and ((path / INFO_FILE).exists() or inside or runs):
        what, newest = (
            ("run folder", runs[0][1][-1]) if runs else ("checkpoint", inside[-1] if inside else path)
        )
        return ConfigError(
            f"{path} is a titanrush {what}, not a Hugging Face folder: export it first "
            f"(titanrush convert --to-hf {newest} OUT_DIR) and pass OUT_DIR"
        )
    if runs:
        folder, steps = runs[0]
        return ConfigError(
            f"{path} is a run folder; its checkpoints are in {folder}: pass {steps[-1]} (the newest) or "
            "another step-<N> there"
        )
    if want != "hf" and any(_STEP.fullmatch(p.name) for p in path.glob("step-*")):
        return ConfigError(
            f"{path} holds step-<N> folders but none with {INFO_FILE} (saves that did not finish?): pass a "
            "complete .../checkpoint/step-<N> folder"
        )
    if want == "either":
        return ConfigError(
            f"{path} holds neither a titanrush checkpoint ({INFO_FILE}) nor an HF config.json: pass {wanted}"
        )
    return ConfigError(f"{path} holds no {'config.json' if want == 'hf' else INFO_FILE}: pass {wanted}")


def weights_folder(path: str | Path) -> tuple[Path, bool]:
    """(the folder path names, whether it is a Hugging Face folder) for a command that reads a whole model:
    a titanrush checkpoint (a step folder, a checkpoint folder's newest step, an import) or an HF folder.

    Raises:
        ConfigError: anything else (a file, a run folder, ...), saying what to pass instead.
    """
    p = Path(path).expanduser()
    return (p, True) if is_hf_folder(p) else (_step_folder(p, "either"), False)


def hf_folder(path: str | Path) -> Path:
    """path, a Hugging Face model folder (one that holds a config.json); ConfigError otherwise."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    raise wrong_path(p, "hf")


def _info_args(info_file: Path) -> tuple[ModelArgs, dict[str, Any]]:
    """(the shape in titanrush.json's model_args, with the runtime fields at their defaults; the info).

    A Llama 4 checkpoint (its arguments name `n_experts`) gives Llama4Args.
    """
    folder = info_file.parent
    try:
        with reading(folder):
            info = read_info(folder)  # (its shape checked, as a resume checks it)
    except ValueError as e:
        if isinstance(denied := e.__cause__, PermissionError):
            raise ConfigError(
                f"checkpoint {folder} cannot be read: {unreadable_message(denied, folder)}"
            ) from None
        raise ConfigError(f"checkpoint {folder} is corrupt: {e}; use another step") from None
    if info is None:  # (each caller has just seen it)
        raise CheckpointRemoved(folder)
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
    if p.is_file() and p.name == INFO_FILE:
        return _info_args(p)[0]
    if p.is_file() and p.suffix == ".json":
        return args_from_hf_config(read_json(p), p)
    if is_hf_folder(p):
        return args_from_hf_config(read_json(p / "config.json"), p / "config.json")
    return _info_args(_step_folder(p, "either") / INFO_FILE)[0]


def training_tokenizer(checkpoint_dir: str | Path) -> str:
    """The `data.tokenizer` a checkpoint was trained with, as far as the files say.

    The tokenizer.json an import carries in the checkpoint folder; else the tokenizer file its
    titanrush.json records (absolute); else `data.tokenizer` of the run's config.toml (the run folder
    holds `<checkpoint.folder>/step-<N>`); else "default".
    """
    path = Path(checkpoint_dir).expanduser().resolve()
    if (path / "tokenizer.json").exists():
        return str(path / "tokenizer.json")
    try:
        recorded = read_json(_step_folder(path) / INFO_FILE).get("tokenizer")
    except ConfigError:
        recorded = None
    if isinstance(recorded, str) and recorded:
        return recorded
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

    checkpoint_dir is a `step-<N>` folder, or a checkpoint folder whose newest complete step is taken
    (the newest left, where the run writing it prunes that one while it is read: `pruned.newest_kept`).
    ModelArgs holds the shape (the runtime fields at their defaults).
    """
    return newest_kept(checkpoint_dir, lambda: _read_step(_step_folder(checkpoint_dir)))


def _read_step(path: Path) -> tuple[dict[str, torch.Tensor], ModelArgs, dict[str, Any]]:
    """read_checkpoint of the step folder path."""
    if (denied := first_unreadable(path)) is not None:  # (a permission is no damage: never "corrupt")
        raise ConfigError(f"checkpoint {path} cannot be read: {unreadable_message(denied, path)}")
    with reading(path):
        return _read_weights(path)


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], ModelArgs, dict[str, Any]]:
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
    problems = verify(path, record) if record is not None else data_problems(path)
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
