"""Whether a checkpoint fits this run, decided before any tensor is read, and what a resume changes.

- `model_arg_differences`: the saved model arguments (`titanrush.json`) against this run's, every field
  that changes the weights' layout or the function computed; run-time choices are not compared.
- `state_differences`: the states this run will load (flattened as DCP flattens them) against the
  checkpoint's index: missing entries, tensors where objects are stored and the reverse, other shapes.
- `data_position_problem`: the saved data loader position against this run's data and batch layout.
- `data_change_problem`: the train data's fingerprint at the save against this run's (the same path may
  hold other data now).
- `apply_run_settings`: after a load, the optimizer's settings and the learning-rate schedule are this
  run's (a checkpoint restores its own), and each difference is said.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.stateful import Stateful

from titanrush.checkpoint.folder import summarize
from titanrush.config import ConfigError
from titanrush.data import fingerprint
from titanrush.distributed import all_ranks
from titanrush.files import one_line
from titanrush.models.llama import ModelArgs
from titanrush.models.llama4 import Llama4Args

logger = logging.getLogger("titanrush")

# Model arguments that are run-time choices: the kernel, how K/V heads are laid out for context
# parallel, the loss's chunking, the RoPE table's length and the longest sequence (the table is computed,
# never saved). Every other field changes the weights or the function and is compared.
RUNTIME_ARGS = frozenset(
    {
        "attn_backend",
        "expand_kv",
        "loss_chunk_size",
        "compile_loss",
        "rope_positions",
        "max_seq_len",
        # Llama 4: the experts' kernel, and the balance losses' weights (scaled by the run's batch layout)
        "grouped_mm",
        "aux_loss_weight",
        "z_loss_weight",
    }
)
# Fields compared through what they determine (n_kv_heads None means n_heads; multiple_of and
# ffn_dim_multiplier only through the hidden size they give).
_DERIVED: dict[str, tuple[str, Callable[[ModelArgs], Any]]] = {
    "n_kv_heads": ("n_kv_heads", lambda a: a.kv_heads),
    "multiple_of": ("the feed-forward size (multiple_of, ffn_dim_multiplier)", lambda a: a.ffn_hidden),
    "ffn_dim_multiplier": ("the feed-forward size (multiple_of, ffn_dim_multiplier)", lambda a: a.ffn_hidden),
    # Llama 4: moe_hidden 0 means a size derived from the dense one (and multiple_of)
    "moe_hidden": ("the experts' hidden size (moe_hidden)", lambda a: a.expert_hidden),
}
_ROPE_SCALING = (
    "rope_scale_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
)


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None), str)) else str(value)


def model_arg_differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """'<field> is <saved> there, <here> here' for each compared model argument that differs.

    A field the checkpoint does not record (saved before it existed) counts as its default. A field this
    code does not know (one since removed, or added by a newer titanrush) is not compared: whether it
    mattered cannot be known here, and the entries and shapes are compared next anyway.
    """
    moe = "n_experts" in saved, "n_experts" in here  # (Llama 4's arguments extend the dense Llama's)
    if moe[0] != moe[1]:
        kinds = ["a Llama 4 mixture-of-experts model" if m else "a dense Llama" for m in moe]
        return [f"the model is {kinds[0]} there, {kinds[1]} here"]
    cls = Llama4Args if moe[0] else ModelArgs
    known = {f.name: f for f in dataclasses.fields(cls)}
    there = cls(**{k: v for k, v in saved.items() if k in known})
    mine = cls(**{k: v for k, v in here.items() if k in known})
    out: list[str] = []
    for name in known:
        if name in RUNTIME_ARGS or (name in _ROPE_SCALING and not (there.rope_scaling or mine.rope_scaling)):
            continue
        label, get = _DERIVED.get(name, (name, lambda a, n=name: getattr(a, n)))
        a, b = get(there), get(mine)
        line = f"{label} is {_fmt(a)} there, {_fmt(b)} here"
        if a != b and line not in out:
            out.append(line)
    return out


def model_arg_hint(saved_info: dict[str, Any], here_info: dict[str, Any]) -> str:
    """The settings that rebuild the checkpoint's model, for a message."""
    saved, here = saved_info.get("model_args", {}), here_info.get("model_args", {})
    keys = []
    if saved_info.get("flavor") and saved_info.get("flavor") != here_info.get("flavor"):
        keys.append(f"model.flavor = {saved_info['flavor']!r}")
    if "vocab_size" in saved and saved["vocab_size"] != here.get("vocab_size"):
        keys.append(f"model.vocab_size = {saved['vocab_size']}")
    if "tie_embeddings" in saved and saved["tie_embeddings"] != here.get("tie_embeddings"):
        keys.append(f"model.tie_embeddings = {'tied' if saved['tie_embeddings'] else 'untied'}")
    if not keys:  # the same keys, another definition of the flavor (or a checkpoint from elsewhere)
        return "run with the model the checkpoint was saved with (its titanrush.json has the arguments)"
    return "run with the checkpoint's model: " + ", ".join(keys)


def flat_state(states: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """The states as DCP flattens them for a load: {'optimizer.state.<name>.exp_avg': tensor, ...}."""
    sd = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}
    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(sd, metadata)
    return dict(planner.state_dict)


def state_differences(flat: dict[str, Any], metadata: Metadata) -> dict[str, list[str]]:
    """Per state ('model', 'optimizer', ...): what this run needs that the checkpoint lacks or stores
    differently (a tensor where an object is stored and the reverse, another shape)."""
    stored = metadata.state_dict_metadata
    out: dict[str, list[str]] = {}
    for key, value in flat.items():
        group = key.split(".", 1)[0]
        meta = stored.get(key)
        is_tensor = isinstance(value, torch.Tensor)
        if meta is None:
            problem = f"{key} is missing there"
        elif is_tensor != (not isinstance(meta, BytesStorageMetadata)):
            here, there = ("a tensor", "an object") if is_tensor else ("an object", "a tensor")
            problem = f"{key} is {there} there, {here} here"
        elif is_tensor and tuple(meta.size) != tuple(value.shape):
            problem = f"{key} has shape {tuple(meta.size)} there, {tuple(value.shape)} here"
        else:
            continue
        out.setdefault(group, []).append(problem)
    return out


class ObjectReader(Stateful):
    """Reads a state's stored objects (not its tensors) in a small load of their own, before the big one."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.values: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {k: None for k in self.keys}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = dict(state_dict)


def object_keys(metadata: Metadata, group: str) -> list[str]:
    """The stored non-tensor entries of one state, without the state's prefix."""
    prefix = group + "."
    return [
        k[len(prefix) :]
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(m, BytesStorageMetadata)
    ]


_DATA_KEYS = (
    ("dataset", "data.dataset"),
    ("split", "the split"),
    ("seq_len", "training.seq_len"),
    ("seed", "training.seed"),
)


def data_position_problem(saved: dict[str, Any], here: dict[str, Any]) -> tuple[str, str]:
    """(why the saved data position cannot be resumed by this run's loader, what to do); ('', '') when it
    resumes exactly. The position is a count of windows of one stream: another dataset, seq_len or seed is
    another stream, and another batch layout must divide the count."""
    diffs = [(cfg, saved[k], here.get(k)) for k, cfg in _DATA_KEYS if k in saved and saved[k] != here.get(k)]
    if diffs:
        there = ", ".join(f"{k} = {_fmt(a)}" for k, a, _ in diffs)
        mine = ", ".join(f"{k} = {_fmt(b)}" for k, _, b in diffs)
        return (
            f"the data loader state was saved for {there}, this run has {mine}: resuming the data position "
            "is impossible (it counts windows of another stream)",
            f"keep {there}",
        )
    if "windows" not in saved or "local_batch_size" not in here or "dp_degree" not in here:
        return "", ""
    windows, per = saved["windows"], here["local_batch_size"] * here["dp_degree"]
    if windows % per == 0:
        return "", ""
    layout = (
        f"dp={saved['dp_degree']} with local batch {saved['local_batch_size']}"
        if "dp_degree" in saved and "local_batch_size" in saved
        else "another batch layout"
    )
    return (
        f"the data loader state was saved for {layout} after {windows} windows, this run has "
        f"dp={here['dp_degree']} with local batch {here['local_batch_size']} ({per} windows a micro-batch): "
        f"{windows} is not a multiple of {per}, so resuming the data position is impossible",
        f"choose training.local_batch_size x dp dividing {windows} (the saved layout does)",
    )


def data_change_problem(
    path: Path, saved: dict[str, Any], here: dict[str, Any], *, allow: bool
) -> tuple[str, str]:
    """(how the train data changed since the checkpoint was saved, what to do); ('', '') when it did not,
    when `allow` (data.allow_changed: the change is said as a warning instead), or when there is nothing to
    compare (this run took no fingerprint: another rank than 0, synthetic data; a checkpoint saved before
    fingerprints, said in a line)."""
    mine, theirs = here.get("data"), saved.get("data", False)
    if not mine:
        return "", ""
    if theirs is False:
        logger.info(
            f"checkpoint {path} records no data fingerprint (saved by an earlier titanrush): the data "
            "it read is not compared with this run's"
        )
        return "", ""
    if not isinstance(theirs, dict):
        return "", ""
    changed, notes = fingerprint.changes(theirs, mine)
    for note in notes:
        logger.info(note)
    if not changed:
        return "", ""
    what = f"the train data changed since the save: {summarize(changed, limit=3)}"
    if allow:
        logger.warning(
            f"resuming {path} on changed data (data.allow_changed): {what}; the data position continues on "
            "another token stream, and the next checkpoints record the data as it is now"
        )
        return "", ""
    where = (
        "run with the Python whose standard library it read (data.dataset = 'embedded')"
        if mine.get("dataset") == "embedded"
        else "point data.path at the data it was saved with"
    )
    return (
        f"{what} (resuming would continue on another token stream)",
        f"{where}, or add --data.allow_changed to resume on this data knowingly",
    )


# Param-group keys by the config keys that set them (the others, such as `fused`, by their own name).
_SETTING_NAMES = {
    "initial_lr": "optimizer.lr",
    "betas": "optimizer.beta1/beta2",
    "eps": "optimizer.eps",
    "weight_decay": "optimizer.weight_decay",
}


def capture_settings(optimizers: list[torch.optim.Optimizer]) -> list[list[dict[str, Any]]]:
    """Each param group's settings (everything but the parameters and the current rate), before a load."""
    return [
        [{k: _copy(v) for k, v in g.items() if k not in ("params", "lr")} for g in opt.param_groups]
        for opt in optimizers
    ]


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def apply_run_settings(
    optimizers: list[torch.optim.Optimizer],
    scheduler: Any,
    before: list[list[dict[str, Any]]],
    schedule_changes: list[str],
) -> str:
    """Give the param groups this run's settings again after a load restored the checkpoint's, and, where
    the peak rate or the schedule differ, the rate this run's schedule gives for the next step.

    Returns:
        A line naming each difference and the rate now in effect ('' when nothing differs).
    """
    changes: list[str] = []
    lr_changed = False
    for opt, groups in zip(optimizers, before):
        for g, mine in zip(opt.param_groups, groups):
            for k, v in mine.items():
                if k not in g or _same(g[k], v):
                    continue
                label = _SETTING_NAMES.get(k, k)
                line = f"{label} {_fmt(_plain(g[k]))} -> {_fmt(_plain(v))}"
                if line not in changes:
                    changes.append(line)
                lr_changed |= k == "initial_lr"
                g[k] = _copy(v)
    if not changes and not schedule_changes:
        return ""
    rates = ""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if (lr_changed or schedule_changes) and lambdas is not None and optimizers:
        groups = optimizers[0].param_groups
        old = _plain(groups[0]["lr"])
        scheduler.base_lrs = [_plain(g.get("initial_lr", b)) for g, b in zip(groups, scheduler.base_lrs)]
        for g, base, fn in zip(groups, scheduler.base_lrs, lambdas):
            value = base * fn(scheduler.last_epoch)
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(value)
            else:
                g["lr"] = value
        new = _plain(groups[0]["lr"])
        rates = f": the next step's rate is {new:.4g} (the checkpoint's settings gave {old:.4g})"
    return "; ".join(changes + schedule_changes) + rates


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.as_tensor(a).float().cpu().equal(torch.as_tensor(b).float().cpu()))
    return a == b


def schedule_changes(saved: dict[str, Any] | None, here: dict[str, Any] | None) -> list[str]:
    """'<key> <saved> -> <here>' for each schedule setting (`titanrush.json`'s `schedule`) that changed."""
    if not saved or not here:
        return []
    return [f"{k} {_fmt(saved[k])} -> {_fmt(v)}" for k, v in here.items() if k in saved and saved[k] != v]


def check_compatible(
    path: Path,
    metadata: Metadata,
    saved: dict[str, Any],
    here: dict[str, Any],
    states: dict[str, Any],
    *,
    own: bool,
    model_only: bool,
    tensors: bool = True,
    allow_data_change: bool = False,
) -> None:
    """Compare everything this run will load with the checkpoint, reading no tensor (every rank calls
    this; the findings of all ranks are joined, so every rank raises the same error).

    Args:
        saved, here: the checkpoint's titanrush.json and this run's (`model_args`, `optimizer`, ...).
        states: the states to load (a `dataloader` among them is an `ObjectState`).
        own: the checkpoint is the run's own (the advice differs from one given by load_path).
        tensors: compare the entries and shapes of `states` with the index (False: only the model
            arguments and the data position, for `--check`, which builds no model).
        allow_data_change: data.allow_changed: train data that changed since the save is said, not refused.

    Raises:
        ConfigError: "checkpoint ... is incompatible with this run: <what differs>. To load it: <how>".
    """
    problems: list[str] = []
    advice: list[str] = []
    diffs = model_arg_differences(saved.get("model_args", {}), here.get("model_args", {}))
    args_differ = bool(saved.get("model_args")) and bool(diffs)
    if args_differ:
        problems.append("model: " + summarize(diffs, limit=6))
        advice.append(model_arg_hint(saved, here))
    if not model_only:
        text, fix = data_change_problem(path, saved, here, allow=allow_data_change)
        if text:
            problems.append(text)
            advice.append(fix)
    other_optimizer = saved.get("optimizer") not in (None, here.get("optimizer"))
    if other_optimizer and not model_only and not tensors:  # (--check builds no optimizer: its name says it)
        problems.append(
            f"optimizer: saved by {saved['optimizer']!r}, this run's is {here.get('optimizer')!r}"
        )
        advice.append(f"set optimizer.name = {saved['optimizer']!r} (the optimizer it was saved with)")
    by_state: dict[str, list[str]] = {}
    if tensors:
        flat = flat_state(states, metadata)
        by_state = state_differences(flat, metadata)
        # every rank's weights (pipeline stages hold different ones)
        expected = set(all_ranks(sorted(k for k in flat if k.startswith("model."))))
        stored = metadata.state_dict_metadata
        extra = sorted(k for k in stored if k.startswith("model.") and k not in expected)
        if extra:
            by_state.setdefault("model", []).append(f"{summarize(extra)} are there, not in this model")
    if "dataloader" in states:
        reader = ObjectReader(object_keys(metadata, "dataloader"))
        if reader.keys:
            with warnings.catch_warnings():  # (the single-process load is what is meant here)
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"dataloader": reader}, checkpoint_id=str(path), no_dist=True)  # a few small objects
            text, fix = data_position_problem(reader.values, states["dataloader"].obj.state_dict())
            if text:
                problems.append(text)
                advice.append(fix)
    for name, lines in by_state.items():
        if args_differ and name in ("model", "optimizer"):
            continue  # the arguments say why
        problems.append(f"{name} state: {summarize(lines, limit=2)}")
        if name == "model":
            advice.append(model_arg_hint(saved, here))
        if name in ("optimizer", "lr_scheduler") and other_optimizer:
            advice.append(f"set optimizer.name = {saved['optimizer']!r} (the optimizer it was saved with)")
    problems, advice = all_ranks(problems), all_ranks(advice)  # (pipeline stages see different weights)
    if not problems:
        return
    weights_fit = not any(p.startswith(("model:", "model state:")) for p in problems)
    if not model_only and weights_fit:
        new_run = f"--job.name <new name> --checkpoint.load_path {path} --checkpoint.load_model_only"
        flag = "add --checkpoint.load_model_only"
        advice.append(f"take only its weights into a new run: {new_run if own else flag}")
    if own and not weights_fit:  # (another model in the same run folder: usually meant as a new run)
        advice.append("train this model from scratch in a folder of its own: --job.name <new name>")
    raise ConfigError(
        f"checkpoint {path} is incompatible with this run: {'; '.join(problems)}. To load it: "
        + ("; or ".join(advice) or "start without it: no setting of this run loads it")
    )


def load_failure(
    path: Path, e: BaseException, *, verified: bool, saved: dict[str, Any], hint: str
) -> ConfigError:
    """A failure inside DCP's load, after every check passed, named for what it is: a state that does not
    fit, files that this torch cannot read although they are as saved, or (without a record) either."""
    text = one_line(e)
    low = text.lower()
    if isinstance(e, ConfigError) or "missing key" in low or "size mismatch" in low or "configerror" in low:
        return ConfigError(f"checkpoint {path} is incompatible with this run: {text}")
    if verified:
        return ConfigError(
            f"checkpoint {path} is incompatible with torch {torch.__version__}: reading it failed ({text}) "
            "although every file matches its integrity record (the files are as saved); load it with the "
            f"torch that saved it ({saved.get('torch', 'its version is not recorded')})"
        )
    return ConfigError(
        f"checkpoint {path} is corrupt or unreadable: reading it failed ({text}), and it has no integrity "
        f"record to tell damage from incompatibility; {hint}"
    )
