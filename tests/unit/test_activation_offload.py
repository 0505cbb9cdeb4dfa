"""Activation offload's bookkeeping on CPU (where the host copy is a second CPU tensor): the same losses and
gradients, parameters left in place, groups fetched ahead and forgotten after backward; the config's checks.

The GPU side (pinned copies on a side stream, the memory they free): tests/gpu/test_activation_offload_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from titanrush import config
from titanrush.config import ConfigError
from titanrush.models.init import _canonical
from titanrush.models.llama import Llama, model_args
from titanrush.parallel import activation_offload
from titanrush.parallel.activation_checkpoint import ACPlan, apply_ac
from titanrush.parallel.activation_offload import (
    ActivationOffloader,
    apply_offload,
    bind_near_gpu,
    parse_cpulist,
)
from titanrush.parallel.compile import apply_compile

CPU = torch.device("cpu")


def run(offload_first: int, *, compiled: bool, ac: str = "none", fetches: list | None = None):
    """Loss, gradients and offloader of one step of a small Llama with the first blocks offloaded."""
    torch.manual_seed(0)
    model = Llama(model_args("debug", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128))
    model.init_weights(seed=1)
    apply_ac(model, ACPlan(mode=ac, offload_first=offload_first), compiled=compiled)
    if compiled:
        apply_compile(model)
    offloader = apply_offload(model, offload_first, CPU)
    if offloader is not None:
        offloader.min_bytes = 1  # the debug model's tensors are small
        if fetches is not None:
            fetch = offloader._fetch

            def record(group, items):
                fetches.append(sorted({s.group.position for s in items}))
                fetch(group, items)

            offloader._fetch = record
    tokens = torch.randint(0, 128, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    grads = {_canonical(n): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, offloader


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offload_gives_the_same_loss_and_gradients(compiled):
    # The reference keeps the same blocks' tensors on the device under the same AC (op keeping every
    # matmul output when compiled), so every kernel is the same: bitwise equality.
    loss, grads, _ = run(0, compiled=compiled, ac="selective" if compiled else "none")
    loss_off, grads_off, offloader = run(2, compiled=compiled, ac="selective" if compiled else "none")
    assert loss_off == loss
    assert grads_off.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_off[name], g, rtol=0, atol=0, msg=name)
    assert offloader.bytes_offloaded > 0
    assert offloader._groups == {}, "every group is forgotten once its tensors are back"


def test_each_block_fetches_the_next_ones_ahead():
    # In backward the blocks run 3, 2, 1, 0. Block 3 has no block after it to fetch it ahead, so its own
    # backward fetches it; block 3 starting its backward fetches 2 and 1, block 2 then fetches 0.
    fetches: list = []
    run(4, compiled=False, fetches=fetches)
    assert fetches == [[2], [1], [3], [0]]


def test_parameters_and_small_tensors_stay_in_place():
    offloader = ActivationOffloader(CPU, min_bytes=64)
    layer = torch.nn.Linear(8, 8)
    keep = activation_offload._storages(layer.parameters())
    group = activation_offload._Group(0, 0)
    assert offloader._pack(layer.weight, group, keep) is layer.weight
    view = layer.weight.t()
    assert offloader._pack(view, group, keep) is view  # a view of a parameter: its storage
    small = torch.ones(4)
    assert offloader._pack(small, group, keep) is small
    gaps = torch.ones(16, 16)[:, ::2]
    assert offloader._pack(gaps, group, keep) is gaps  # a host copy would not have its strides
    big = torch.ones(8, 8).t()  # transposed: dense, so offloaded with its strides
    saved = offloader._pack(big, group, keep)
    assert isinstance(saved, activation_offload._Saved)
    back = offloader._unpack(saved)
    assert back.stride() == big.stride() and torch.equal(back, big)
    assert offloader.bytes_offloaded == big.numel() * 4


def test_ac_with_offload_leaves_eager_blocks_unwrapped_and_compiled_ones_keeping_every_matmul():
    from titanrush.parallel.activation_checkpoint import CheckpointedBlock

    for compiled in (False, True):
        model = Llama(model_args("debug", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128))
        apply_ac(model, ACPlan(mode="full", offload_first=2), compiled=compiled)
        wrapped = [isinstance(b, CheckpointedBlock) for b in model.layers.values()]
        assert wrapped == [compiled, compiled, True, True]


def test_offload_config_errors():
    from titanrush.run.plan import build_plan

    with pytest.raises(ConfigError, match="offload_first must be >= 0"):
        build_plan(config.load(None, ["--activation_checkpoint.offload_first", "-1"]), 1)
    with pytest.raises(ConfigError, match="offload_first = 9: the debug model has"):
        build_plan(config.load(None, ["--activation_checkpoint.offload_first", "9"]), 1, machine=False)
    if not torch.cuda.is_available():
        cfg = config.load(None, ["--activation_checkpoint.offload_first", "1"])
        with pytest.raises(ConfigError, match="offload_first needs a CUDA GPU"):
            build_plan(cfg, 1)


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()


def test_bind_near_gpu_reads_the_gpu_node_cpus_from_sysfs(tmp_path, monkeypatch):
    import contextlib
    import os
    import threading
    import types

    now = os.sched_getaffinity(0)
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    dev = tmp_path / "0000:1b:00.0"
    dev.mkdir()
    mine = min(now)
    (dev / "local_cpulist").write_text(f"{mine}\n")
    done = threading.Event()
    other = threading.Thread(target=done.wait)  # a thread started before the binding
    other.start()

    def restore() -> None:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), now)

    try:
        got = bind_near_gpu(torch.device("cuda", 0), sysfs=str(tmp_path))
        if len(now) > 1:
            assert got == {mine}
            assert os.sched_getaffinity(0) == {mine}
            assert os.sched_getaffinity(other.native_id) == {mine}  # every thread, not only this one
        else:
            assert got is None
    finally:
        restore()
        done.set()
        other.join()
    # Unknown device (no sysfs entry) or a node with none of our CPUs: nothing changes.
    props.pci_bus_id = 0x2C
    assert bind_near_gpu(torch.device("cuda", 0), sysfs=str(tmp_path)) is None
    (dev / "local_cpulist").write_text("100000-100001\n")
    props.pci_bus_id = 0x1B
    assert bind_near_gpu(torch.device("cuda", 0), sysfs=str(tmp_path)) is None
    assert os.sched_getaffinity(0) == now
