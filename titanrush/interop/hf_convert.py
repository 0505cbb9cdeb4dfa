"""Conversions that write: a titanrush checkpoint to a Hugging Face folder (`export_hf`) or one `.pt` file
(`export_pt`), and a Hugging Face folder to a model-only titanrush checkpoint (`import_hf`).

Reading checkpoints and Hugging Face folders, and picking the mapping, is `titanrush.interop.hf`. Every output
is written under temporary names and renamed into place: a refused or failed conversion leaves nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titanrush.checkpoint.integrity import RECORD_FILE, record_folder
from titanrush.config import ConfigError
from titanrush.files import check_writable, one_line, os_error
from titanrush.interop.hf import (
    BIAS_FILE,
    INFO_FILE,
    TOKENIZER_FILES,
    args_from_hf_config,
    cast_state_dict,
    flavor_of,
    from_hf_state_dict,
    hf_config,
    hf_folder,
    read_checkpoint,
    read_json,
    to_hf_state_dict,
    training_tokenizer,
)
from titanrush.interop.hf_mapping import first_few
from titanrush.interop.safetensors_io import load_hf_weights, load_safetensors, save_safetensors
from titanrush.models.llama.flavors import CUSTOM
from titanrush.models.llama4 import FLAVORS as LLAMA4_FLAVORS
from titanrush.models.llama4 import Llama4Args

__all__ = ["export_hf", "export_pt", "import_hf", "pt_file"]


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
    """Save {"model": state dict, "model_args": dict, "step": N} as one `.pt` file (torch.load-able).

    out_path is the file; where it is an existing folder or ends with a path separator, the file is
    `model.pt` in that folder (made if need be), as `cp` puts a file into a folder. Returns the file.
    """
    out = pt_file(out_path)
    _check_output(out, folder=False)
    sd, args, info = read_checkpoint(checkpoint_dir)
    blob = {
        "model": cast_state_dict(sd, dtype, args.tie_embeddings),
        "model_args": dataclasses.asdict(args),
        "step": info.get("step"),
        "flavor": info.get("flavor"),
    }
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


def pt_file(out_path: str | Path) -> Path:
    """The file `export_pt` writes for out_path: itself, or `model.pt` in it where it is a folder (an
    existing one, or a path that ends with a separator); never inside a checkpoint folder."""
    out = Path(out_path)
    if not (out.is_dir() or str(out_path).endswith(("/", os.sep))):
        return out
    if (out / INFO_FILE).exists() or (out / ".metadata").exists():
        raise ConfigError(f"{out} is a checkpoint folder: write the .pt file outside it (e.g. {out.parent})")
    return out / "model.pt"


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
    src, out = hf_folder(hf_dir), Path(out_checkpoint_dir)
    _check_output(out, folder=True, verb="import")
    args = args_from_hf_config(read_json(src / "config.json"), src / "config.json")
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
            raise ConfigError(
                f"{src / 'tokenizer.json'} has {words} ids, the model's vocabulary only "
                f"{args.vocab_size}: {src} holds another model's tokenizer"
            )
    sd = cast_state_dict(from_hf_state_dict(load_hf_weights(src), args), torch.float32, args.tie_embeddings)
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
    info = {
        "step": 0,
        "flavor": moe_flavor or CUSTOM,
        "architecture": moe_flavor or flavor_of(args),
        "model_args": dataclasses.asdict(args),
        "model_only": True,
        "dtype": "float32",
        "source": str(src.resolve()),
        "integrity": RECORD_FILE,  # (a run from it verifies its bytes, as it does its own saves)
    }
    made = _missing_folders(out.parent)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copyfile(src / name, tmp / name)
        record_folder(tmp)
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
