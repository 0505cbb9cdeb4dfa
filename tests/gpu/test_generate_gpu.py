"""`titanrush generate` on a GPU: the KV-cached decoding on CUDA equals recomputing the sequence (fp32), bf16
decoding runs with the cache in bf16, and the command picks the GPU and samples reproducibly there."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.generate import KVCache, generate
from titanrush.tools import generate as generate_cmd

ARGS = model_args("debug", n_layers=2, max_seq_len=256)


def _model(device: str) -> Llama:
    with torch.device("meta"):
        model = Llama(ARGS)
    model.to_empty(device=device)
    model.init_weights(seed=3, buffer_device=torch.device(device))
    return model.eval()


def _cast(model: Llama, dtype: torch.dtype) -> Llama:
    for p in model.parameters():  # (not model.to(dtype): that would make the complex RoPE table real)
        p.data = p.data.to(dtype)
    return model.eval()


def test_cached_greedy_equals_recomputation_on_cuda():
    model = _model("cuda")
    prompt = [11, 42, 7, 99, 3]
    new = generate(model, prompt, max_new_tokens=16)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            tokens.append(int(model(torch.tensor([tokens], device="cuda"))[0, -1].argmax()))
    assert new == tokens[len(prompt) :]


def test_bf16_decoding_keeps_a_bf16_cache():
    model = _cast(_model("cuda"), torch.bfloat16)
    cache = KVCache.empty(model, 1, 32)
    assert cache.keys[0].dtype == torch.bfloat16 and cache.keys[0].is_cuda
    new = generate(model, [1, 2, 3], max_new_tokens=8, temperature=0.7, top_p=0.9, seed=2)
    assert len(new) == 8 and new == generate(
        model, [1, 2, 3], max_new_tokens=8, temperature=0.7, top_p=0.9, seed=2
    )


def test_command_runs_on_the_gpu(tmp_path: Path, capsys):
    model = _model("cpu")
    step = tmp_path / "run" / "checkpoint" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    info = {"step": 1, "flavor": "debug", "model_args": ARGS.__dict__, "model_only": True}
    (step / "titanrush.json").write_text(json.dumps(info))
    argv = ["--checkpoint", str(step), "--prompt", "def f(", "--max-new-tokens", "8", "--temperature", "0.9"]
    assert generate_cmd.main(argv) == 0  # --device auto: the GPU, in bf16
    first = capsys.readouterr()
    assert first.out.startswith("def f(") and "tokens/s" in first.err
    assert generate_cmd.main(argv) == 0
    assert capsys.readouterr().out == first.out
