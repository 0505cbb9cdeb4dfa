"""Checkpoints through torch.distributed.checkpoint (DCP): save, resume, reshard, crash safety.

A checkpoint is the folder `<run>/<checkpoint.folder>/step-<N>/`: a DCP checkpoint (keys `model.*`,
`optimizer.*`, `lr_scheduler`, `dataloader`, `train_state`) plus `titanrush.json` (step, flavor,
model arguments). It is written under `step-<N>.tmp/` and renamed once every rank has written its part,
so a folder named `step-<N>` is always complete; a run killed mid-save leaves only a `.tmp` folder, which
resumption ignores. DCP stores every tensor under its global name and shape, so a checkpoint saved on one
mesh loads on any other (FSDP2 -> one process, -> TP, -> PP).

Timings go to `records` for the trainer to log (metrics.jsonl and the console): each save, once it is
complete and renamed, gives `ckpt_mode` (the async mode, or `model_only` for a model-only save, always
synchronous), `ckpt_blocking_s` (how long the training loop was held: the save call, including any wait
for the previous save still in flight, plus, for async_pinned, the wait for staging before the next
optimizer step) and `ckpt_save_s` (from the save call until the checkpoint is written, plus the rename,
which rank 0 does at the first step after; that step's wait is not counted); a resume gives `ckpt_load_s`
(reading, resharding and setting the state, until every rank is done). Times are rank 0's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titanrush.config import ConfigError
from titanrush.distributed import barrier

logger = logging.getLogger("titanrush")
# One process saves without a process group on purpose; DCP warns about exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

STEP_DIR = re.compile(r"^step-(\d+)$")
INFO_FILE = "titanrush.json"


class ModelState(Stateful):
    """The model parts' weights under their canonical names (wrappers' prefixes removed)."""

    def __init__(self, parts: list[nn.Module], dtype: torch.dtype | None = None) -> None:
        self.parts = parts
        self.dtype = dtype

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part in self.parts:
            sd.update(get_model_state_dict(part))
        if self.dtype is not None:
            sd = {k: v.to(self.dtype) for k, v in sd.items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    """Optimizer states keyed by parameter name, so they reshard like the weights."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            osd = get_optimizer_state_dict(
                part, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
            sd.update(osd)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state_dict, options=opts)


class ObjectState(Stateful):
    """Any object with state_dict()/load_state_dict() whose state is the same on every rank."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


def stager_reusable() -> bool:
    """Whether one DCP `DefaultStager` (and its pinned buffers) serves several saves.

    torch 2.11's stager closes its inner stager after every save, so a second save through it fails
    (`KeyError: <class 'type'>`, pytorch/pytorch#183413); 2.12 and later keep it open. A fresh stager per
    save is always correct, only slower.
    """
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.12.0"  # (a 2.12 pre-release: not)


@dataclasses.dataclass
class TrainState:
    """The step and the random generators' states (rank 0's; training draws no per-rank randomness)."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"step": self.step, "rng": _to_bytes(rng)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        rng = _from_bytes(state_dict["rng"])
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def _to_bytes(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in folder, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / ".metadata").exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


class CheckpointManager:
    """Saves every `interval` steps and at the end, prunes, and resumes from the newest complete save."""

    def __init__(
        self,
        folder: Path,
        *,
        enable: bool,
        interval: int,
        keep_latest_k: int,
        async_mode: str,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        lr_scheduler: Any,
        dataloader: Any,
        info: dict[str, Any],
        rank: int,
    ) -> None:
        self.folder = folder
        self.enable = enable
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.rank = rank
        self.info = info
        self.train_state = TrainState()
        self.model_parts = model_parts
        self.states: dict[str, Any] = {
            "model": ModelState(model_parts),
            "optimizer": OptimizerState(model_parts, optimizers),
            "lr_scheduler": ObjectState(lr_scheduler),
            "dataloader": ObjectState(dataloader),
            "train_state": self.train_state,
        }
        self._pending: _PendingSave | None = None
        # Background saves run their collectives on a gloo group of their own, off the training streams.
        use_pg = enable and async_mode != "disabled" and dist.is_initialized()
        self._pg = dist.new_group(backend="gloo") if use_pg else None
        self._stager = None
        if enable and async_mode == "async_pinned":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
            self._stager_options = options
            self._stager = DefaultStager(options)
            self._stager_used = False
        self.records: list[tuple[int, dict[str, Any]]] = []  # (step, values) not yet logged

    # --------------------------------------------------------------------------------------------
    # Loading

    def resume(self, *, load_path: str = "", model_only: bool = False) -> int:
        """Load the newest complete checkpoint of this run, else `load_path`.

        Returns:
            The step to continue from (0 for a weights-only start).
        """
        own = complete_checkpoints(self.folder) if self.enable else []
        if own:
            path = own[-1][1]
            model_only = False
        elif load_path:
            path = Path(load_path)
            if STEP_DIR.match(path.name) is None and complete_checkpoints(path):
                path = complete_checkpoints(path)[-1][1]  # a checkpoint folder: take its newest
        else:
            return 0
        t0 = time.perf_counter()
        self._load(path, model_only=model_only)
        barrier()  # loaded on every rank
        step = 0 if model_only else self.train_state.step
        self.records.append((step, {"ckpt_load_s": time.perf_counter() - t0, "ckpt_load_path": str(path)}))
        what = "weights" if model_only else "full state"
        logger.info(f"loaded {what} from {path}" + ("" if model_only else f", resuming after step {step}"))
        return step

    def _load(self, path: Path, *, model_only: bool) -> None:
        metadata = _read_metadata(path)
        saved_info = _read_info(path)
        if saved_info.get("model_only") and not model_only:
            raise ConfigError(
                f"checkpoint {path} holds only model weights; set checkpoint.load_model_only = true to start "
                "a new run from it"
            )
        self._check_compatible(path, metadata, saved_info)
        states = {"model": self.states["model"]} if model_only else self.states
        try:
            dcp.load(states, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # a data file truncated, missing or unreadable
            raise ConfigError(
                f"checkpoint {path} could not be read ({type(e).__name__}: {str(e)[-300:]}); it is corrupt: "
                "resume from an earlier checkpoint or delete this one"
            ) from e

    def _check_compatible(self, path: Path, metadata: Any, saved_info: dict[str, Any]) -> None:
        """Name what differs between the checkpoint's model and this run's, before loading anything."""
        stored = metadata.state_dict_metadata
        expected = ModelState(self.model_parts).state_dict()
        problems = []
        flavor = saved_info.get("flavor")
        if flavor and flavor != self.info.get("flavor"):
            problems.append(
                f"it was saved by model.flavor = {flavor!r}, this run uses {self.info.get('flavor')!r}"
            )
        missing = [k for k in expected if f"model.{k}" not in stored]
        if missing:
            problems.append(f"missing weights {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        for k, v in expected.items():
            meta = stored.get(f"model.{k}")
            if meta is not None and hasattr(meta, "size") and tuple(meta.size) != tuple(v.shape):
                problems.append(f"{k} has shape {tuple(meta.size)} there, {tuple(v.shape)} here")
                if len(problems) > 5:
                    break
        if problems:
            raise ConfigError(f"checkpoint {path} does not fit this model: " + "; ".join(problems))

    # --------------------------------------------------------------------------------------------
    # Saving

    def maybe_save(
        self, step: int, *, last: bool, model_only: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        """Save when step is a multiple of the interval, or the last step."""
        if not self.enable:
            return
        self.poll()
        if self.due(step, last=last):
            self.save(step, model_only=model_only and last, dtype=dtype if last and model_only else None)

    def due(self, step: int, *, last: bool) -> bool:
        """Whether maybe_save saves at this step."""
        return self.enable and (last or step % self.interval == 0)

    def save(self, step: int, *, model_only: bool = False, dtype: torch.dtype | None = None) -> Path:
        """Write step-<step>.tmp, then rename it to step-<step> once it is complete on every rank."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        self.train_state.step = step
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            if final.exists():
                raise ConfigError(f"checkpoint {final} already exists; it is never overwritten")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        states = {"model": ModelState(self.model_parts, dtype)} if model_only else self.states
        info = {**self.info, "step": step, "model_only": model_only,
                "dtype": str(dtype or torch.float32).replace("torch.", "")}  # fmt: skip
        record = {"ckpt_mode": "model_only" if model_only else self.async_mode}
        if record["ckpt_mode"] in ("disabled", "model_only"):
            dcp.save(states, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
            self._finish(tmp, final, info)
            elapsed = time.perf_counter() - t0
            self.records.append((step, {**record, "ckpt_blocking_s": elapsed, "ckpt_save_s": elapsed}))
            return final
        kwargs: dict[str, Any] = {"checkpoint_id": str(tmp), "process_group": self._pg,
                                  "no_dist": not dist.is_initialized()}  # fmt: skip
        if self._stager is not None:
            if self._stager_used and not stager_reusable():
                from torch.distributed.checkpoint.staging import DefaultStager

                self._stager = DefaultStager(self._stager_options)  # pins its buffers again
            self._stager_used = True
            kwargs["async_stager"] = self._stager
        result = dcp.async_save(states, **kwargs)
        upload = getattr(result, "upload_completion", result)  # async_pinned: an AsyncSaveResponse
        staging = getattr(result, "staging_completion", None)
        pending = _PendingSave(upload, tmp, final, info, step, record, t0, staging=staging)
        pending.upload.add_done_callback(lambda _: setattr(pending, "uploaded_at", time.perf_counter()))
        pending.blocking_s = time.perf_counter() - t0
        self._pending = pending
        return final

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied the state off the training tensors.

        Call before anything changes them in place (the optimizer step): async_pinned stages in the
        background while the next forward and backward run. The wait counts as blocking time."""
        p = self._pending
        if p is None or p.staging is None:
            return
        t0 = time.perf_counter()
        p.staging.result()
        p.staging = None
        p.blocking_s += time.perf_counter() - t0

    def poll(self) -> None:
        """Finish a background save that has completed (cheap; called every step)."""
        if self._pending is not None and self._pending.upload.done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save in flight (if any) is complete and renamed."""
        if self._pending is None:
            return
        p, self._pending = self._pending, None
        p.upload.result()
        uploaded = p.uploaded_at or time.perf_counter()  # the callback may run just after result()
        t_finish = time.perf_counter()
        self._finish(p.tmp, p.final, p.info, all_ranks=False)
        save_s = uploaded - p.t0 + time.perf_counter() - t_finish  # written, then renamed
        self.records.append((p.step, {**p.record, "ckpt_blocking_s": p.blocking_s, "ckpt_save_s": save_s}))

    def _finish(self, tmp: Path, final: Path, info: dict[str, Any], all_ranks: bool = True) -> None:
        # A synchronous DCP save returns on each rank after the coordinator wrote the metadata, which it
        # does only after gathering every rank's write results; an async save's future likewise.
        if all_ranks:
            barrier()
        if self.rank == 0:
            (tmp / INFO_FILE).write_text(json.dumps(info, indent=1, default=str))
            os.replace(tmp, final)
            _fsync_dir(final.parent)
            self._prune()

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        done = complete_checkpoints(self.folder)
        for _, path in done[: max(len(done) - self.keep_latest_k, 0)]:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


@dataclasses.dataclass
class _PendingSave:
    """A background save in flight, and what its record needs once it completes."""

    upload: Future
    tmp: Path
    final: Path
    info: dict[str, Any]
    step: int
    record: dict[str, Any]
    t0: float
    staging: Future | None = None  # async_pinned: done once the state is copied off the training tensors
    blocking_s: float = 0.0
    uploaded_at: float | None = None


def _read_metadata(path: Path) -> Any:
    if not path.is_dir():
        raise ConfigError(f"checkpoint folder {path} does not exist; check checkpoint.load_path")
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise ConfigError(f"checkpoint {path} is incomplete or corrupt (its DCP metadata cannot be read: "
                          f"{type(e).__name__}); use an earlier checkpoint") from e  # fmt: skip


def _read_info(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / INFO_FILE).read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path / INFO_FILE} is corrupt ({e}); use an earlier checkpoint") from e


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
