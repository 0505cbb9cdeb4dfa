"""Checkpoints through torch.distributed.checkpoint (DCP): save, resume, reshard, crash safety, integrity.

A checkpoint is the folder `<run>/<checkpoint.folder>/step-<N>/`: a DCP checkpoint (keys `model.*`,
`optimizer.*`, `lr_scheduler`, `dataloader`, `train_state`), `titanrush.json` (step, flavor, model
arguments, schedule settings, the train data's fingerprint) and `integrity.json` (every file's size and
CRC-32 checksums, `checkpoint/integrity.py`). It is written under `step-<N>.tmp/` and renamed once every
rank has written its part and the record is written, so a folder named `step-<N>` is complete; a run
killed mid-save leaves only a `.tmp` folder, which resumption ignores. DCP stores every tensor under its
global name and shape, so a checkpoint saved on one mesh loads on any other (FSDP2 -> one process, ->
TP, -> PP).

Loading checks, in this order and before any tensor is read: the folder is complete (a step folder of
this run that is not is moved aside to `step-<N>.incomplete-<n>`, and the run resumes from the newest
complete one), its files match the integrity record (else it is *corrupt*), and it fits this run: the
model arguments, the train data (its fingerprint, unless data.allow_changed), every state's entries and
shapes, the data position (else it is *incompatible*, and the message says what differs and what to do).
A failed save (a full disk) removes its `.tmp` folder, leaves earlier checkpoints alone and stops the run
with a `RunError` (`docs/checkpoint.md`).

Timings go to `records` for the trainer to log (metrics.jsonl and the console): each save, once it is
complete and renamed, gives `ckpt_mode` (the async mode, or `model_only` for a model-only save, always
synchronous), `ckpt_blocking_s` (how long the training loop was held: the save call, including any wait
for the previous save still in flight, plus, for async_pinned, the wait for staging before the next
optimizer step), `ckpt_save_s` (from the save call until the checkpoint is written, plus the rename,
which rank 0 does at the first step after; that step's wait is not counted) and `ckpt_integrity_s` (rank
0's checksumming, inside `ckpt_save_s`); a resume gives `ckpt_load_s` (verifying, reading, resharding
and setting the state, until every rank is done) and `ckpt_verify_s` (the integrity check, inside it).
Times are rank 0's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
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

from titanrush.checkpoint import compat, integrity
from titanrush.checkpoint.choose import check_folder, choose, elsewhere, verify_files
from titanrush.checkpoint.folder import INFO_FILE, scan, unreadable_error
from titanrush.checkpoint.space import prepare_save, save_failure, space_warning, unwritable_error
from titanrush.checkpoint.state import ModelState, ObjectState, OptimizerState, TrainState
from titanrush.config import ConfigError
from titanrush.distributed import barrier, from_rank0
from titanrush.errors import RunError

logger = logging.getLogger("titanrush")
# One process saves without a process group on purpose; DCP warns about exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def stager_reusable() -> bool:
    """Whether one DCP `DefaultStager` (and its pinned buffers) serves several saves.

    torch 2.11's stager closes its inner stager after every save, so a second save through it fails
    (`KeyError: <class 'type'>`, pytorch/pytorch#183413); 2.12 and later keep it open. A fresh stager per
    save is always correct, only slower.
    """
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.12.0"  # (a 2.12 pre-release: not)


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
        allow_data_change: bool = False,
    ) -> None:
        """`info` goes into each checkpoint's titanrush.json: `flavor`, `model_args` (compared on load),
        `optimizer` (its name), `schedule` (the learning-rate settings, whose changes a resume names) and
        `data` (the train data's fingerprint, compared on a resume unless `allow_data_change`).

        Raises:
            ConfigError: checkpoints are on and the folder cannot be made or written (checked now, by
                rank 0, rather than at the first save).
        """
        self.folder = folder
        self.enable = enable
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.rank = rank
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.info = info
        self.allow_data_change = allow_data_change
        self.train_state = TrainState(rank)
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.scheduler = lr_scheduler
        self.states: dict[str, Any] = {
            "model": ModelState(model_parts),
            "optimizer": OptimizerState(model_parts, optimizers),
            "lr_scheduler": ObjectState(lr_scheduler),
            "dataloader": ObjectState(dataloader),
            "train_state": self.train_state,
        }
        self._pending: _PendingSave | None = None
        self._last: Path | None = None  # the newest checkpoint, whose size the next save needs
        if enable:
            error = from_rank0(unwritable_error(folder) if rank == 0 else "")
            if error:
                raise ConfigError(error)
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

    def resume(self, *, load_path: str = "", model_only: bool = False, steps: int | None = None) -> int:
        """Load the newest complete full checkpoint of this run, else `load_path`.

        Args:
            load_path: A `step-<N>` folder, or a checkpoint folder (its newest complete one is taken).
            model_only: With load_path: only the weights, for a new run (step 0).
            steps: `training.steps`: a checkpoint past it is refused before anything loads; one at it is
                said (the run then has nothing to train and ends with status 0).

        Returns:
            The step to continue from (0 for a weights-only start).
        """
        decision: dict[str, Any] = {}
        if self.rank == 0:
            try:
                decision = choose(self.folder if self.enable else None, load_path, model_only)
            except PermissionError as e:  # (met while looking, before anything is moved aside)
                decision = {"error": unreadable_error(e)}
        choice = json.loads(from_rank0(json.dumps(decision)))
        if choice.get("error"):
            raise ConfigError(choice["error"])
        if not choice.get("path"):
            return 0
        path, model_only, own = Path(choice["path"]), choice["model_only"], choice["own"]
        t0 = time.perf_counter()
        verify_s = self._load(path, model_only=model_only, own=own, steps=steps)
        barrier()  # loaded on every rank
        step = 0 if model_only else self.train_state.step
        self.records.append(
            (
                step,
                {
                    "ckpt_load_s": time.perf_counter() - t0,
                    "ckpt_load_path": str(path),
                    "ckpt_verify_s": verify_s,
                },
            )
        )
        what = "weights" if model_only else "full state"
        logger.info(f"loaded {what} from {path}" + ("" if model_only else f", resuming after step {step}"))
        if own:
            self._last = path
        if self.enable and self.rank == 0 and (warning := space_warning(self.folder, self._last, step + 1)):
            logger.warning(warning)
        return step

    def _load(self, path: Path, *, model_only: bool, own: bool, steps: int | None) -> float:
        """Check, then load; returns the integrity check's seconds. Every failure is a ConfigError that
        says corrupt, incomplete or incompatible, what differs and what to do (the same on every rank)."""
        saved = check_folder(path, own=own, model_only=model_only, steps=steps)
        t0 = time.perf_counter()
        verified = verify_files(path, own=own, rank=self.rank, world_size=self.world_size)
        verify_s = time.perf_counter() - t0
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure to unpickle the index: verified or not, below
            raise compat.load_failure(
                path, e, verified=verified, saved=saved, hint=elsewhere(path, own)
            ) from None
        states = {"model": self.states["model"]} if model_only else self.states
        self.train_state.loading = True
        try:
            self.train_state.load_rng = self._rng_entry(metadata)
            try:  # (reads the data loader's saved objects)
                compat.check_compatible(
                    path,
                    metadata,
                    saved,
                    self.info,
                    states,
                    own=own,
                    model_only=model_only,
                    allow_data_change=self.allow_data_change,
                )
            except CheckpointException as e:  # DCP's read failed: classified, never pasted
                hint = elsewhere(path, own)
                raise compat.load_failure(path, e, verified=verified, saved=saved, hint=hint) from None
            before = compat.capture_settings(self.optimizers)
            try:
                dcp.load(states, checkpoint_id=str(path), no_dist=not dist.is_initialized())
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - classified, never pasted
                hint = elsewhere(path, own)
                raise compat.load_failure(path, e, verified=verified, saved=saved, hint=hint) from None
        finally:
            self.train_state.loading = False
        if not model_only:
            self._say_settings(saved, before, steps)
        return verify_s

    def _rng_entry(self, metadata: Any) -> str | None:
        """This rank's RNG entry to load: its own where the checkpoint has one per rank of this world."""
        stored = [k for k in metadata.state_dict_metadata if k.startswith("train_state.rng")]
        per_rank = [k for k in stored if k.startswith("train_state.rng_rank")]
        if f"train_state.rng_rank{self.rank}" in stored and len(per_rank) == self.world_size:
            return f"rng_rank{self.rank}"
        if "train_state.rng" in stored:  # saved before per-rank states: rank 0's for every rank
            return "rng"
        if per_rank and self.rank == 0:
            logger.info(
                f"RNG states were saved by {len(per_rank)} ranks, this run has {self.world_size}: each rank "
                "keeps its generators as training.seed set them"
            )
        return None

    def _say_settings(self, saved: dict[str, Any], before: list, steps: int | None) -> None:
        """After a full load: this run's optimizer settings and schedule are in effect; say what changed."""
        changes = compat.schedule_changes(saved.get("schedule"), self.info.get("schedule"))
        line = compat.apply_run_settings(self.optimizers, self.scheduler, before, changes)
        if line and self.rank == 0:
            logger.warning(f"resumed with this run's settings, not the checkpoint's: {line}")
        if steps is not None and self.train_state.step == steps and self.rank == 0:
            logger.warning(
                f"the checkpoint at step {steps} already reaches training.steps = {steps}: nothing to train "
                "(exit status 0); raise training.steps to continue"
            )

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
        """Write step-<step>.tmp, then rename it to step-<step> once it is complete on every rank.

        Raises:
            RunError: The save failed (a full disk, an unwritable folder): its `.tmp` is removed, earlier
                checkpoints are untouched, and the message says what to do.
        """
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        self.train_state.step = step
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        error = from_rank0(prepare_save(self.folder, final, tmp, step, self._last) if self.rank == 0 else "")
        if error:
            raise RunError(error)
        states = {"model": ModelState(self.model_parts, dtype)} if model_only else self.states
        info = {
            **self.info,
            "step": step,
            "model_only": model_only,
            "world_size": self.world_size,
            "dtype": str(dtype or torch.float32).replace("torch.", ""),
            "torch": torch.__version__,
            "integrity": integrity.RECORD_FILE,
        }
        record = {"ckpt_mode": "model_only" if model_only else self.async_mode}
        writer = integrity.IntegrityWriter(tmp)
        if record["ckpt_mode"] in ("disabled", "model_only"):
            try:
                dcp.save(
                    states, storage_writer=writer, checkpoint_id=str(tmp), no_dist=not dist.is_initialized()
                )
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a write failure, named below
                self._save_failed(e, tmp, step)
            hash_s = self._finish(tmp, final, info, writer, step)
            elapsed = time.perf_counter() - t0
            self.records.append(
                (
                    step,
                    {
                        **record,
                        "ckpt_blocking_s": elapsed,
                        "ckpt_save_s": elapsed,
                        "ckpt_integrity_s": writer.hash_s + hash_s,
                    },
                )
            )
            return final
        kwargs: dict[str, Any] = {"checkpoint_id": str(tmp), "storage_writer": writer}
        kwargs |= {"process_group": self._pg, "no_dist": not dist.is_initialized()}
        if self._stager is not None:
            if self._stager_used and not stager_reusable():
                from torch.distributed.checkpoint.staging import DefaultStager

                self._stager = DefaultStager(self._stager_options)  # pins its buffers again
            self._stager_used = True
            kwargs["async_stager"] = self._stager
        result = dcp.async_save(states, **kwargs)
        upload = getattr(result, "upload_completion", result)  # async_pinned: an AsyncSaveResponse
        staging = getattr(result, "staging_completion", None)
        pending = _PendingSave(upload, tmp, final, info, step, record, t0, writer, staging=staging)
        pending.upload.add_done_callback(lambda _: setattr(pending, "uploaded_at", time.perf_counter()))
        pending.blocking_s = time.perf_counter() - t0
        self._pending = pending
        return final

    def _save_failed(self, e: BaseException, tmp: Path, step: int) -> None:
        """Name a failed save, remove its partial folder (rank 0), and stop the run."""
        text = save_failure(e, self.folder, tmp, step, self._last)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not text:
            raise e
        raise RunError(text) from e

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
        """Block until the background save in flight (if any) is complete and renamed.

        Raises:
            RunError: The save failed (see `save`).
        """
        if self._pending is None:
            return
        p, self._pending = self._pending, None
        try:
            p.upload.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a write failure, named there
            self._save_failed(e, p.tmp, p.step)
        uploaded = p.uploaded_at or time.perf_counter()  # the callback may run just after result()
        t_finish = time.perf_counter()
        hash_s = self._finish(p.tmp, p.final, p.info, p.writer, p.step, all_ranks=False)
        save_s = uploaded - p.t0 + time.perf_counter() - t_finish  # written, then renamed
        self.records.append(
            (
                p.step,
                {
                    **p.record,
                    "ckpt_blocking_s": p.blocking_s,
                    "ckpt_save_s": save_s,
                    "ckpt_integrity_s": p.writer.hash_s + hash_s,
                },
            )
        )

    def _finish(
        self,
        tmp: Path,
        final: Path,
        info: dict,
        writer: integrity.IntegrityWriter,
        step: int,
        all_ranks: bool = True,
    ) -> float:
        """Rank 0: titanrush.json and the integrity record, then the rename; returns the record's seconds.
        A synchronous DCP save returns on each rank after the coordinator wrote the metadata, which it does
        only after gathering every rank's write results; an async save's future likewise."""
        if all_ranks:
            barrier()
        if self.rank != 0:
            return 0.0
        try:
            (tmp / INFO_FILE).write_text(json.dumps(info, indent=1, default=str))
            hash_s = integrity.record_folder(tmp, writer)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as e:
            self._save_failed(e, tmp, step)
        self._last = final
        self._prune()
        return hash_s

    def _prune(self) -> None:
        """Keep the newest keep_latest_k full checkpoints (model-only exports: not counted, not pruned)."""
        if self.keep_latest_k <= 0:
            return
        full = [s for s in scan(self.folder) if s.complete and not s.model_only]
        for s in full[: max(len(full) - self.keep_latest_k, 0)]:
            shutil.rmtree(s.path, ignore_errors=True)

    def close(self) -> None:
        try:
            self.wait()
        finally:
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
    writer: integrity.IntegrityWriter
    staging: Future | None = None  # async_pinned: done once the state is copied off the training tensors
    blocking_s: float = 0.0
    uploaded_at: float | None = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
