"""flash-attn-4's kernels compiled by a child process beside the set-up (`flash_warm_up`), with a stand-in
FA4 package on disk that both processes import and that notes each kernel call in a file."""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap

import pytest
import torch

from titanrush.models import flash_warm_up
from titanrush.models.llama import attention as attn

STAND_IN = """
import os, threading
import torch


def _note(kind, q, k):
    if os.environ.get("STAND_IN_FAIL_PID") == str(os.getppid()):  # (set to the pid of the child's parent)
        raise RuntimeError("no kernel for this GPU")
    who = f"{os.getpid()}|{threading.current_thread().name}"
    with open(os.environ["STAND_IN_LOG"], "a") as f:
        f.write(f"{who}|{kind}|{tuple(q.shape)} {tuple(k.shape)}\\n")


def _flash_attn_fwd(q, k, v, causal=False, return_lse=False, **kw):
    _note("fwd", q, k)
    b, t, h, _ = q.shape
    return torch.zeros_like(q), torch.zeros(b, h, t), None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False):
    _note("bwd", q, k)
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
"""

STAND_IN_INIT = """
import torch
from flash_attn.cute import interface


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return interface._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[0]

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return interface._flash_attn_bwd(q, k, v, dout, dout, None, causal=True)


def flash_attn_func(q, k, v, causal):
    return _Function.apply(q, k, v)
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The stand-in package importable here and in a child (PYTHONPATH); the path of its call log."""
    root = tmp_path / "site"
    (root / "flash_attn" / "cute").mkdir(parents=True)
    (root / "flash_attn" / "__init__.py").write_text("")
    (root / "flash_attn" / "cute" / "__init__.py").write_text(textwrap.dedent(STAND_IN_INIT))
    (root / "flash_attn" / "cute" / "interface.py").write_text(textwrap.dedent(STAND_IN))
    log = tmp_path / "calls.txt"
    for name in [m for m in sys.modules if m.startswith(("flash_attn", "flash_attn_interface"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    attn.flash_attn_func.cache_clear()
    attn.flash_kernels.cache_clear()
    yield log
    for name in [m for m in sys.modules if m.startswith("flash_attn")]:  # the stand-in's, imported here
        del sys.modules[name]
    attn.flash_attn_func.cache_clear()
    attn.flash_kernels.cache_clear()
    attn._PREPARING = None


def _calls(log) -> list[tuple[str, ...]]:
    """(who, kind, q's shape, k's shape), who being 'child' or this process's thread."""
    rows = []
    for line in log.read_text().splitlines():
        pid, thread, kind, shapes = line.split("|")
        rows.append(("child" if int(pid) != os.getpid() else thread, kind, shapes))
    return rows


SHAPES = attn.FlashShapes(torch.device("cpu"), batch=2, seq_len=16, n_heads=4, n_kv_heads=2, head_dim=8,
                          in_graph=True, dtype=torch.float32)  # fmt: skip
WARM = "(2, 16, 4, 8) (2, 16, 2, 8)"
TRAIN = "(1, 8, 4, 8) (1, 8, 2, 8)"


def test_shapes_travel_to_the_child_as_json():
    half = attn.FlashShapes(torch.device("cuda", 3), 1, 8192, 8, 2, 128, in_graph=False, dtype=torch.float16)
    for shapes in (SHAPES, half):
        assert flash_warm_up.from_json(flash_warm_up.to_json(shapes)) == shapes
    assert json.loads(flash_warm_up.to_json(half))["device"] == "cuda:3"


@pytest.mark.parametrize("in_graph", [True, False])
def test_a_child_process_compiles_the_kernels_and_training_then_calls_them(stand_in, caplog, in_graph):
    """The child runs the warm-up's forward and backward at the training's shapes; this process's
    thread only imports and waits, and training's first flash call waits for it."""
    import dataclasses

    logging.getLogger("titanrush").propagate = True
    with caplog.at_level(logging.INFO, logger="titanrush"):
        thread = attn.prepare_flash_in_background(dataclasses.replace(SHAPES, in_graph=in_graph))
        q = torch.randn(1, 8, 4, 8, requires_grad=True)
        k, v = torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
        attn.attention(q, k, v, backend="flash", n_rep=2, flash_in_graph=in_graph).sum().backward()
        thread.join(timeout=60)
    assert not thread.is_alive()
    child = [("child", "fwd", WARM), ("child", "bwd", WARM)]
    assert _calls(stand_in) == [*child, ("MainThread", "fwd", TRAIN), ("MainThread", "bwd", TRAIN)]
    assert "flash-attn-4's kernels compiled in" in caplog.text
    assert "by a process beside the set-up" in caplog.text


def test_a_failed_child_is_logged_and_step_1_compiles_them(stand_in, caplog, monkeypatch):
    # (a failure that repeats, as an FA4 error would, is not run twice: training's first call compiles)
    monkeypatch.setenv("STAND_IN_FAIL_PID", str(os.getpid()))  # the stand-in fails in this process's child
    logging.getLogger("titanrush").propagate = True
    with caplog.at_level(logging.INFO, logger="titanrush"):
        thread = attn.prepare_flash_in_background(SHAPES)
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert "warm-up process failed (exit status 1: " in caplog.text
    assert "RuntimeError: no kernel for this GPU" in caplog.text  # the end of the child's stderr
    assert "step 1 compiles its kernels" in caplog.text
    assert not stand_in.exists()  # no kernel call in this process


def test_without_the_disk_cache_the_thread_compiles_them(stand_in, caplog, monkeypatch):
    # A child's kernels would not reach this process: the thread compiles them, and no child starts.
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    started = []
    monkeypatch.setattr(flash_warm_up.WarmUpProcess, "at", lambda *a: started.append(a))
    thread = attn.prepare_flash_in_background(SHAPES)
    thread.join(timeout=60)
    assert not started
    assert _calls(stand_in) == [("flash-attn prepare", "fwd", WARM), ("flash-attn prepare", "bwd", WARM)]


TRAIN_ARGS = ["--model.attn_backend", "flash", "--training.seq_len", "16", "--training.local_batch_size", "2"]
LAUNCH = "(2, 16, 8, 32) (2, 16, 4, 32)"  # the debug model's 8 heads, 4 K/V heads, head dim 32


def _trainer_shapes(args: list[str]) -> attn.FlashShapes:
    from titanrush import config
    from titanrush.trainer import check_config, flash_shapes

    cfg = config.load(None, args)
    dims, model_args, _ = check_config(cfg, 1)
    return flash_shapes(cfg, dims, model_args, torch.device("cpu"))


@pytest.mark.parametrize("trainer_seq", [16, 32])
def test_the_child_started_at_launch_serves_the_trainer(stand_in, caplog, trainer_seq):
    """titanrush.train starts the child once the config is read; it works the shapes out of the same
    arguments, and the trainer's thread waits for it instead of starting one. Where the trainer's shapes
    are not the ones it compiled (they are the same config's; here forced), another child compiles them."""
    from titanrush import config
    from titanrush.train import start_flash_warm_up

    logging.getLogger("titanrush").propagate = True
    child = start_flash_warm_up(config.load(None, TRAIN_ARGS), TRAIN_ARGS)
    assert child is not None
    args = [*TRAIN_ARGS, "--training.seq_len", str(trainer_seq)]
    with caplog.at_level(logging.INFO, logger="titanrush"):
        thread = attn.prepare_flash_in_background(_trainer_shapes(args), started=child)
        thread.join(timeout=120)
    assert not thread.is_alive()
    calls = _calls(stand_in)
    assert calls[:2] == [("child", "fwd", LAUNCH), ("child", "bwd", LAUNCH)]
    if trainer_seq == 16:
        assert len(calls) == 2 and "compiled by a process started at launch" in caplog.text
    else:
        again = "(2, 32, 8, 32) (2, 32, 4, 32)"
        assert calls[2:] == [("child", "fwd", again), ("child", "bwd", again)]
        assert "launch warm-up compiled the kernels of" in caplog.text
        assert "by a process beside the set-up" in caplog.text


def test_a_launch_child_that_compiled_nothing_is_said_so_and_another_compiles(stand_in, caplog):
    # The launch child's arguments give no fixed shapes (a pipeline: it reports none), the trainer's do.
    logging.getLogger("titanrush").propagate = True
    none = flash_warm_up.WarmUpProcess(
        "titanrush.train", ["--flash-warm-up", *TRAIN_ARGS, "--parallelism.pp", "2"]
    )
    with caplog.at_level(logging.INFO, logger="titanrush"):
        attn._warm_up_by_a_child(SHAPES, none, dict(os.environ))
    assert "launch warm-up compiled no kernels; training runs" in caplog.text
    assert _calls(stand_in) == [("child", "fwd", WARM), ("child", "bwd", WARM)]


def test_python_m_titanrush_train_starts_its_child_under_its_own_name(monkeypatch, tmp_path):
    # Run as `python -m titanrush.train` the module is __main__: the child must still be started as
    # titanrush.train, and reaped when the run ends (here, at a config error after the start).
    import runpy

    started = []

    class Fake:
        def __init__(self, module, args, env=None):
            started.append((module, args))
            self.killed = False

        def kill(self):
            started.append("killed")

    monkeypatch.setattr(flash_warm_up, "WarmUpProcess", Fake)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    argv = [
        "--model.attn_backend",
        "flash",
        "--training.seq_len",
        "999999",
        "--job.dump_folder",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", ["titanrush.train", *argv])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("titanrush.train", run_name="__main__", alter_sys=True)
    assert exit.value.code == 2  # the trainer's config error (the sequence exceeds the model's maximum)
    assert started == [("titanrush.train", ["--flash-warm-up", *argv]), "killed"]
    import importlib.util

    import titanrush.train

    assert importlib.util.find_spec(titanrush.train.MODULE).origin == titanrush.train.__file__


@pytest.mark.parametrize(
    "args, env",
    [(["--model.attn_backend", "sdpa"], "1"), (["--parallelism.pp", "2"], "1"),
     (["--parallelism.cp", "2"], "1"), ([], "0")],
)  # fmt: skip
def test_no_child_at_launch_where_it_would_not_serve(monkeypatch, args, env):
    # Other attention, shapes that vary (pipeline micro-batches, context parallel shards), or no disk
    # cache for a child's kernels to reach the trainer through; flash attention alone starts one.
    from titanrush import config
    from titanrush.train import start_flash_warm_up

    monkeypatch.setattr(flash_warm_up, "WarmUpProcess", lambda module, a: ("child", module, a))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    child = start_flash_warm_up(config.load(None, ["--model.attn_backend", "flash"]), ["x"])
    assert child == ("child", "titanrush.train", ["--flash-warm-up", "x"])
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", env)
    assert start_flash_warm_up(config.load(None, ["--model.attn_backend", "flash", *args]), ["x"]) is None


def test_a_child_past_its_time_limit_is_stopped():
    slow = flash_warm_up.WarmUpProcess("http.server", ["0", "--bind", "127.0.0.1"])  # runs until stopped
    failure, shapes = slow.wait(timeout=2)
    assert failure == "still running after 2 s, stopped" and shapes is None
    assert slow._proc.poll() is not None  # stopped and reaped


def test_a_launch_child_is_stopped_where_flash_attn_is_not_fa4(monkeypatch):
    # FA3's hopper build imports (it ships compiled kernels): the launch child has nothing to do
    import types

    fa3 = types.SimpleNamespace(flash_attn_func=lambda q, k, v, causal: q)
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    attn.flash_attn_func.cache_clear()
    attn.flash_kernels.cache_clear()
    killed = []
    child = types.SimpleNamespace(kill=lambda: killed.append(True), wait=lambda: pytest.fail("waited"))
    try:
        thread = attn.prepare_flash_in_background(SHAPES, started=child)
        thread.join(timeout=30)
    finally:
        attn.flash_attn_func.cache_clear()
        attn.flash_kernels.cache_clear()
        attn._PREPARING = None
    assert not thread.is_alive() and killed == [True]
