"""Checkpoint interchange: titanrush DCP checkpoints <-> Hugging Face Llama folders and single `.pt` files.

The mapping itself (names, the RoPE permutation, config.json) is `titanrush.hf_mapping` for the dense
Llama and `titanrush.models.llama4.hf` for Llama 4 (Hugging Face's `Llama4ForCausalLM`); this module
reads and writes the folders and picks the mapping by the model's arguments. An export carries the
training tokenizer and its BOS/EOS ids, so `transformers` loads it and generates from it as it is; an
import writes a model-only checkpoint whose `model_args` a run takes with `model.from_checkpoint`.
"""

from __future__ import annotations

import contextlib
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

from titanrush import hf_mapping
from titanrush.checkpoint_compat import RUNTIME_ARGS, model_arg_differences
from titanrush.checkpoint_folder import check_writable, one_line, os_error, summarize
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
    "BIAS_FILE", "DTYPES", "INFO_FILE", "args_from_hf_config", "export_hf", "export_pt", "flavor_of",
    "from_hf_state_dict", "hf_config", "import_command", "import_hf", "load_hf_weights", "load_safetensors",
    "model_args_at", "read_checkpoint", "save_safetensors", "to_hf_state_dict", "training_tokenizer",
]  # fmt: skip

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
INFO_FILE = "titanrush.json"
BIAS_FILE = "titanrush_expert_bias.safetensors"  # Llama 4's routing biases, beside an export's weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Conversion runs in one process without a process group on purpose; DCP warns about exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


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
    """(the shape in titanrush.json's model_args, with the runtime fields at their defaults; the info).

    A Llama 4 checkpoint (its arguments name `n_experts`) gives Llama4Args.
    """
    info = _read_json(info_file)
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
        return _info_args(p)[0] if p.name == INFO_FILE else args_from_hf_config(_read_json(p), p)
    if p.is_dir() and (p / "config.json").exists() and not (p / INFO_FILE).exists():
        return args_from_hf_config(_read_json(p / "config.json"), p / "config.json")
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
    return _cast(sd, sd["tok_embeddings.weight"].dtype, args.tie_embeddings), args, info


def _verify(path: Path) -> None:
    """Check the step folder's files against its integrity record, as a resume does (none: not checked)."""
    try:
        record = read_record(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: {e}; use another step") from None
    problems = verify(path, record) if record is not None else []
    if problems:
        raise ConfigError(f"checkpoint {path} is corrupt: {summarize(problems)}; use another step")


def _cast(sd: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> dict[str, torch.Tensor]:
    """sd in dtype; when tied, `output.weight` is the embedding tensor (as in `Llama.state_dict()`)."""
    out = {k: v.to(dtype) for k, v in sd.items() if not (tied and k == "output.weight")}
    if tied:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _write_folder(out: Path, files: dict[str, Callable[[Path], object]]) -> None:
    """Write each file under a temporary name, then rename them all: a failure leaves nothing behind."""
    made = _missing_folders(out)
    tmp = {name: out / f".{name}.tmp-{os.getpid()}" for name in files}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, write in files.items():
            write(tmp[name])
    except BaseException as e:
        for p in tmp.values():
            with contextlib.suppress(OSError):
                p.unlink(missing_ok=True)
        _remove_empty(made)
        if isinstance(e, OSError):
            raise _write_error(out, e) from None
        raise
    for name in files:
        os.replace(tmp[name], out / name)


def _missing_folders(out: Path) -> list[Path]:
    """out and those of its parents that do not exist, innermost first (what a write would make)."""
    return [p for p in [out, *out.parents] if not p.exists()]


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed write made (innermost first), where they are still empty."""
    for p in folders:
        with contextlib.suppress(OSError):
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()


def _write_error(out: Path, exc: BaseException) -> ConfigError:
    """The one-line error of a write that failed (a full disk, a folder that cannot be written)."""
    err = os_error(exc)
    why = err.strerror if err is not None and err.strerror else one_line(exc)
    return ConfigError(
        f"cannot write {out} ({why}); nothing was left there: free some space, make the folder writable "
        "or choose another output path"
    )


def _text(content: str) -> Callable[[Path], object]:
    return lambda p: p.write_text(content)


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: str | None = "auto",
) -> Path:
    """Write an HF LlamaForCausalLM (or Llama4ForCausalLM) folder into out_dir; files of other names there
    are kept.

    A Llama 4 whose routing biases moved in training (titanrush's load balance) routes by them, and
    Hugging Face's Llama 4 has no place for them: they go to `BIAS_FILE` beside the weights, where
    `import_hf` takes them back (transformers ignores the file and routes without them).

    Args:
        checkpoint_dir: a `step-<N>` folder or a checkpoint folder (its newest step).
        out_dir: the HF folder: model.safetensors, config.json, generation_config.json and, with a
            tokenizer, tokenizer.json, tokenizer_config.json and special_tokens_map.json.
        dtype: the weights' dtype.
        tokenizer: `data.tokenizer`'s syntax; "auto" takes the one the checkpoint was trained with
            (`training_tokenizer`); None writes no tokenizer (and no BOS/EOS ids).
    """
    _check_output(Path(out_dir), folder=True)
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
    biases = {k: v.float() for k, v in sd.items() if k.endswith(".moe.expert_bias")}
    if any(bool(v.any()) for v in biases.values()):  # Llama 4's routing biases, which HF has no place for
        files[BIAS_FILE] = lambda p: save_safetensors(biases, p, {"format": "pt"})
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


def _check_output(out: Path, folder: bool, verb: str = "export") -> None:
    """A conversion writes a new file, or a folder into a new or empty one, where it can write: never over
    what is there (checked before any weight is read)."""
    try:
        if folder and out.is_dir():
            if any(out.iterdir()):
                raise ConfigError(f"{out} is a folder that is not empty: {verb} into a new or empty folder")
        elif out.exists():
            raise ConfigError(f"{out} exists: {verb} to a new path (or delete it first)")
        problem = check_writable(out if folder else out.parent)
    except OSError as e:  # (a folder that cannot be listed)
        problem = f"{out} cannot be read ({e.strerror or e})"
    if problem:
        raise ConfigError(f"cannot write {out}: {problem}; choose an output path in a writable folder")


def export_pt(checkpoint_dir: str | Path, out_path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Save {"model": state dict, "model_args": dict, "step": N} as one `.pt` file (torch.load-able)."""
    _check_output(Path(out_path), folder=False)
    sd, args, info = read_checkpoint(checkpoint_dir)
    blob = {"model": _cast(sd, dtype, args.tie_embeddings), "model_args": dataclasses.asdict(args),
            "step": info.get("step"), "flavor": info.get("flavor")}  # fmt: skip
    out = Path(out_path)
    made = _missing_folders(out.parent)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:  # (a file object: a failed write is an OSError, not torch's RuntimeError)
            torch.save(blob, f)
        os.replace(tmp, out)
    except OSError as e:
        raise _write_error(out, e) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not out.exists():
            _remove_empty(made)
    return out


def import_hf(hf_dir: str | Path, out_checkpoint_dir: str | Path) -> Path:
    """Write an HF Llama folder as a model-only float32 DCP checkpoint + titanrush.json (+ its tokenizer).

    titanrush.json records `flavor = "custom"` and the model's arguments; train from it in one command
    with `model.flavor = "custom"`, `model.from_checkpoint = <out>`, `checkpoint.load_path = <out>` and
    `checkpoint.load_model_only` (`import_command`). A Llama 4 is recorded under the titanrush flavor of its
    shape (another shape is refused), and a run names that flavor; its routing biases are those of the
    export's `BIAS_FILE` where the folder has one, else zero.
    The HF folder's tokenizer files, where it has them, are copied beside the weights
    (`data.tokenizer = <out>/tokenizer.json`).
    """
    src, out = Path(hf_dir), Path(out_checkpoint_dir)
    if not (src / "config.json").exists():
        raise ConfigError(f"{src / 'config.json'} not found; pass an HF model folder (config.json + weights)")
    _check_output(out, folder=True, verb="import")
    args = args_from_hf_config(_read_json(src / "config.json"), src / "config.json")
    moe_flavor = flavor_of(args) if isinstance(args, Llama4Args) else None
    if moe_flavor == CUSTOM:
        raise ConfigError(
            f"{src / 'config.json'} describes a Llama 4 whose shape is none of titanrush's Llama 4 flavors "
            f"({', '.join(LLAMA4_FLAVORS)}; vocabulary and tied embeddings may differ): titanrush trains "
            "Llama 4 at those shapes only"
        )
    if (src / "tokenizer.json").exists():  # copied beside the weights for a run to read: it must load
        from titanrush.data import build_tokenizer

        try:
            words = build_tokenizer(str(src / "tokenizer.json")).n_words
        except ConfigError as e:
            raise ConfigError(f"{e}; or import the weights alone from a folder without it") from None
        if words > args.vocab_size:
            raise ConfigError(f"{src / 'tokenizer.json'} has {words} ids, the model's vocabulary only "
                              f"{args.vocab_size}: {src} holds another model's tokenizer")  # fmt: skip
    sd = _cast(from_hf_state_dict(load_hf_weights(src), args), torch.float32, args.tie_embeddings)
    if moe_flavor and (src / BIAS_FILE).exists():  # the routing biases of a titanrush export
        biases = load_safetensors(src / BIAS_FILE)
        wrong = [k for k, v in biases.items() if k not in sd or sd[k].shape != v.shape]
        if wrong:
            raise ConfigError(
                f"{src / BIAS_FILE} holds {first_few(wrong)}, which this model has not (so shaped)"
            )
        sd.update(biases)
    # Dense: "custom", the run takes this shape from model_args (model.from_checkpoint), whatever flavor it
    # resembles; `architecture` names that flavor for the reader. Llama 4: the flavor it is.
    info = {"step": 0, "flavor": moe_flavor or CUSTOM, "architecture": moe_flavor or flavor_of(args),
            "model_args": dataclasses.asdict(args), "model_only": True, "dtype": "float32",
            "source": str(src.resolve())}  # fmt: skip
    made = _missing_folders(out.parent)
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
    except (OSError, dcp.CheckpointException) as e:  # (DCP's exception is a BaseException)
        raise _write_error(out, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.exists():
            _remove_empty(made)
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
