"""The parity mode of side_by_side.py (`--parity`): titanrush and torchtitan 0.2.2 train the same model
from the same weights on the same token batches, in the same order, with the same optimizer, schedule
and clipping settings, and every step's loss, gradient norm and learning rate are compared
(`parity_report.py`).

Before a row's two runs, `prepare` makes their inputs:

1. the weights: titanrush's initial weights (its own init, `training.seed`, drawn on the GPU) written as a
   Hugging Face folder in fp32 (`export_weights`); torchtitan loads it through `checkpoint.initial_load_path`
   with `initial_load_in_hf` and its own state-dict adapter, titanrush through its own import
   (`titanrush.interop.hf_convert.import_hf`: a model-only checkpoint, `checkpoint.load_path`);
2. the token batches titanrush's loader yields for the run's steps, per data-parallel rank
   (`dump_batches`); torchtitan reads them in order (torchtitan_compat/tt_parity.py);
3. the settings: `SETTINGS`, written into both trainers' configs (`titanrush_flags`, `torchtitan_settings`).

Each trainer then writes the hashes of the weights it starts from and of every micro-batch it draws
(tt_parity.py, parity_observe.py), which the report holds against the export's and the dump's first.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "torchtitan_compat"))

from batch_dump import weight_hashes, write_dump  # noqa: E402

from titanrush import config  # noqa: E402
from titanrush.data import build_dataloader, build_tokenizer  # noqa: E402
from titanrush.interop.hf import hf_config, to_hf_state_dict  # noqa: E402
from titanrush.interop.hf_convert import import_hf  # noqa: E402
from titanrush.interop.safetensors_io import save_safetensors  # noqa: E402
from titanrush.models.llama import Llama, ModelArgs  # noqa: E402
from titanrush.models.llama4 import Llama4, Llama4Args  # noqa: E402
from titanrush.run.plan import resolve_model_args  # noqa: E402

# Optimizer, schedule and clipping of both trainers in parity mode. Both apply weight decay to every
# parameter (norms and embeddings too) and clip the global norm of all gradients. lr, eps and max_norm
# are side_by_side.row_flags' values; the others are set by titanrush_flags (tests/unit/test_bench_parity.py
# holds both configs to this table).
SETTINGS: dict[str, Any] = {
    "lr": 3e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "warmup_steps": 50,  # (10 made steps 5-16 spike; a spike turns the two runs' rounding into a 40% gap)
    "decay": "linear",
    "min_lr_factor": 0.1,
    "max_norm": 1.0,
    "bias_update_rate": 1e-3,  # Llama 4's routing bias step (torchtitan's: TT_LOAD_BALANCE_COEFF)
}
# The settings row_flags does not set, as titanrush flags.
_EXTRA_FLAGS = {
    "warmup_steps": "lr_scheduler.warmup_steps",
    "beta1": "optimizer.beta1",
    "beta2": "optimizer.beta2",
    "weight_decay": "optimizer.weight_decay",
    "decay": "lr_scheduler.decay",
    "min_lr_factor": "lr_scheduler.min_lr_factor",
}
# Each setting's place in torchtitan's config: (section, key).
_TORCHTITAN_KEYS = {
    "lr": ("optimizer", "lr"),
    "beta1": ("optimizer", "beta1"),
    "beta2": ("optimizer", "beta2"),
    "eps": ("optimizer", "eps"),
    "weight_decay": ("optimizer", "weight_decay"),
    "warmup_steps": ("lr_scheduler", "warmup_steps"),
    "decay": ("lr_scheduler", "decay_type"),
    "min_lr_factor": ("lr_scheduler", "min_lr_factor"),
    "max_norm": ("training", "max_norm"),
}
LLAMA4_PREFIX = "language_model."
"""Llama 4 weights are exported under the multimodal checkpoints' names, which torchtitan's Llama 4 adapter
reads and titanrush's import strips."""


def titanrush_flags(moe: bool = False) -> list[str]:
    """The settings side_by_side.row_flags leaves to titanrush's defaults, set explicitly (`moe`: and the
    routing bias step)."""
    flags = [x for key, flag in _EXTRA_FLAGS.items() for x in (f"--{flag}", str(SETTINGS[key]))]
    return flags + (["--moe.bias_update_rate", str(SETTINGS["bias_update_rate"])] if moe else [])


def torchtitan_settings(cfg: dict[str, dict[str, Any]]) -> None:
    """Write every setting of `SETTINGS` into torchtitan's config (a dict of TOML sections), in place."""
    for key, (section, name) in _TORCHTITAN_KEYS.items():
        cfg.setdefault(section, {})[name] = SETTINGS[key]
    cfg["optimizer"] |= {"name": "AdamW", "implementation": "fused"}


def export_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A titanrush state dict under the names of the parity export (`LLAMA4_PREFIX` on Llama 4)."""
    hf = to_hf_state_dict(sd, args)
    return {LLAMA4_PREFIX + k: v for k, v in hf.items()} if isinstance(args, Llama4Args) else hf


def export_weights(args: ModelArgs, seed: int, folder: Path, device: torch.device) -> dict[str, str]:
    """titanrush's initial weights for `seed` as a Hugging Face folder in fp32 (model.safetensors,
    config.json); returns the hash of every tensor."""
    with torch.device("meta"):
        model = (Llama4 if isinstance(args, Llama4Args) else Llama)(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed, buffer_device=device)
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    del model
    if device.type == "cuda":  # (the runs that follow need the GPU's memory)
        torch.cuda.empty_cache()
    hf = export_state_dict(sd, args)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(hf, folder / "model.safetensors", {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(args, torch.float32), indent=2) + "\n")
    return weight_hashes(hf)


def dump_batches(cfg: config.JobConfig, args: ModelArgs, *, steps: int, dp: int, folder: Path) -> dict:
    """The first `steps` micro-batches of each of the `dp` data-parallel ranks' train loaders, built from
    `cfg` as titanrush's trainer builds them, written to `folder` (`batch_dump.write_dump`)."""
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    t = cfg.training
    iters = [
        iter(
            build_dataloader(
                cfg.data,
                tokenizer=tokenizer,
                seq_len=t.seq_len,
                local_batch_size=t.local_batch_size,
                dp_rank=rank,
                dp_degree=dp,
                seed=t.seed,
                split="train",
                vocab_size=args.vocab_size,
            )
        )
        for rank in range(dp)
    ]
    batches = [[(b.input_ids, b.labels) for b in (next(it) for it in iters)] for _ in range(steps)]
    return write_dump(folder, batches)


@dataclass
class Prepared:
    """One row's inputs: the weights (torchtitan's folder and titanrush's import) and the token batches,
    with the hashes the runs are held to."""

    hf_dir: Path
    checkpoint: Path
    dump: Path
    weights: dict[str, str] = field(default_factory=dict)  # export: {Hugging Face name: hash}
    tokens: list[list[str]] = field(default_factory=list)  # dump: [step][data-parallel rank] -> hash

    @classmethod
    def at(cls, scratch: Path) -> Prepared:
        """Where `prepare` puts a row's inputs (no hashes yet)."""
        return cls(scratch / "hf", scratch / "titanrush_import", scratch / "batches")


def prepare(flags: list[str], *, steps: int, dp: int, scratch: Path) -> Prepared:
    """The inputs of a row's parity runs, under `scratch` (large: 4 bytes per parameter, twice).

    Args:
        flags: titanrush's flags of the row's runs, without the checkpoint to load (the model, the data,
            the seed and the batch layout are read from them).
        steps: the runs' steps.
        dp: data-parallel ranks (the batch dump's layout).
    """
    cfg = config.load(None, flags)
    if cfg.training.global_batch_size not in (-1, cfg.training.local_batch_size * dp):
        raise ValueError("parity mode: no gradient accumulation (one micro-batch per step and rank)")
    args = resolve_model_args(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prep = Prepared.at(scratch)
    prep.weights = export_weights(args, cfg.training.seed, prep.hf_dir, device)
    import_hf(prep.hf_dir, prep.checkpoint)
    prep.tokens = dump_batches(cfg, args, steps=steps, dp=dp, folder=prep.dump)["hashes"]
    return prep


def torchtitan_parity(cfg: dict[str, dict[str, Any]], prep: Prepared) -> None:
    """Turn side_by_side's torchtitan config of a row into its parity run, in place: the parity train spec
    (torchtitan_compat/tt_parity.py) reading the batch dump, the exported weights loaded from Hugging Face
    format (and nothing saved), `SETTINGS`, every step logged."""
    cfg["model"] |= {"name": cfg["model"]["name"] + "_parity", "hf_assets_path": str(prep.hf_dir)}
    cfg["training"] |= {"dataset": "titanrush_batches", "dataset_path": str(prep.dump)}
    cfg["checkpoint"] = {
        "enable": True,
        "load_only": True,  # (never saves; its folder under dump_folder does not exist, so it loads:)
        "initial_load_path": str(prep.hf_dir),
        "initial_load_in_hf": True,
        "initial_load_model_only": True,
    }
    cfg["metrics"]["log_freq"] = 1
    cfg["experimental"]["custom_import"] = "tt_parity"
    torchtitan_settings(cfg)
