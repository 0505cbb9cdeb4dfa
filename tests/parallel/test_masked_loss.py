"""The loss is normalized by the global count of valid tokens (issue #27): with masked labels (masking.py)
and gradient accumulation, two ranks (FSDP, a pipeline) match one process on the same global batch, and
the plain and chunked losses give the mean cross-entropy over a step's valid tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import read_metrics
from masking import install_masking, mask_labels, run_masked

from titanrush import config
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer

RTOL = 1e-5  # the parallel parity suite's tolerance (test_parity.py says why)


def in_process_args(dump: Path, name: str, *extra: str) -> list[str]:
    """A debug run in this process: seq 32, batch 2, a metrics row per step, no TensorBoard."""
    return [
        *("--job.dump_folder", str(dump), "--job.name", name, "--training.seq_len", "32"),
        *("--training.local_batch_size", "2", "--training.deterministic", "--lr_scheduler.warmup_steps", "2"),
        *("--metrics.log_freq", "1", "--no-metrics.tensorboard", "--training.gc_freq", "0", *extra),
    ]


MASKED = (
    "--training.steps",
    "3",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.deterministic",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--no-metrics.tensorboard",
    "--training.gc_freq",
    "0",
)


def assert_parity(rows: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        dev = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(rows, ref))
        assert dev <= RTOL, (key, dev, [r[key] for r in rows], [r[key] for r in ref])


@pytest.fixture(scope="module")
def masked_reference(tmp_path_factory) -> list[dict]:
    """One process, local batch 4, two micro-batches per step, masked labels."""
    return run_masked(
        tmp_path_factory.mktemp("masked"), "one", 1, *MASKED, "--training.local_batch_size", "4"
    )


def test_the_mask_is_uneven_across_micro_batches():
    """The premise of the parity tests: averaging per-micro-batch means would weigh tokens unequally."""
    from titanrush.data import build_dataloader, build_tokenizer

    loader = build_dataloader(
        config.Data(), tokenizer=build_tokenizer("default"), seq_len=64, local_batch_size=2, vocab_size=8192
    )
    batches = [mask_labels(b) for b, _ in zip(loader, range(4))]
    counts = [int((b.labels != -100).sum()) for b in batches]
    assert len(set(counts)) > 1 and max(counts) > 1.5 * min(counts), counts


@pytest.mark.parallel
@pytest.mark.parametrize("mesh", ["fsdp2", "pp2"])
def test_masked_tokens_with_accumulation_match_one_process(mesh, tmp_path, masked_reference):
    """2 ranks (FSDP over 2, or a 2-stage 1F1B pipeline), gradient accumulation, masked labels: the loss
    and gradient norm of every step equal those of one process on the same global batch."""
    extra = {
        "fsdp2": ["--training.local_batch_size", "2"],
        "pp2": ["--training.local_batch_size", "4", "--parallelism.pp", "2"],
    }[mesh]
    rows = run_masked(tmp_path, mesh, 2, *MASKED, *extra)
    assert_parity(rows, masked_reference)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the trainer's CPU run against a CPU reference")
def test_the_loss_is_the_mean_over_valid_tokens_on_both_loss_paths(tmp_path, monkeypatch):
    """In-process, masked, two micro-batches per step: step 1's loss is the mean cross-entropy over the
    step's valid tokens (computed here from the same weights and batches), and the chunked loss (training
    and validation) gives what the plain one gives."""
    from titanrush.data import build_dataloader, build_tokenizer
    from titanrush.models.llama import Llama, model_args

    install_masking(monkeypatch.setattr)
    common = (
        "--training.steps",
        "2",
        "--training.global_batch_size",
        "4",
        "--validation.freq",
        "2",
        "--validation.steps",
        "2",
    )
    runs = {}
    for loss in ("plain", "chunked"):
        args = in_process_args(
            tmp_path, loss, *common, "--training.loss", loss, "--training.loss_chunk_size", "40"
        )
        cfg = config.load(None, args)
        trainer = Trainer(cfg, build_plan(cfg, 1))
        try:
            trainer.train()
        finally:
            trainer.close()
        runs[loss] = read_metrics(tmp_path / loss)
    model = Llama(model_args("debug", rope_positions=32))
    model.init_weights(seed=42)
    loader = build_dataloader(
        config.Data(),
        tokenizer=build_tokenizer("default"),
        seq_len=32,
        local_batch_size=4,
        vocab_size=model.args.vocab_size,
    )
    batch = mask_labels(next(iter(loader)))
    with torch.no_grad():
        expect = torch.nn.functional.cross_entropy(
            model(batch.input_ids).flatten(0, 1), batch.labels.flatten()
        )
    plain, chunked = runs["plain"], runs["chunked"]
    assert plain[0]["loss"] == pytest.approx(expect.item(), rel=RTOL)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in chunked if "lr" in r] == pytest.approx(
            [r[key] for r in plain if "lr" in r], rel=RTOL
        )
    val = [next(r["val_loss"] for r in rows if "val_loss" in r) for rows in (plain, chunked)]
    assert val[1] == pytest.approx(val[0], rel=RTOL)
