"""`titanrush generate`: KV-cached decoding against full recomputation and against transformers, sampling,
stopping, and the command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_hf import NO_TRANSFORMERS, make_model, save_checkpoint

from titanrush import cli
from titanrush.data.tokenizer import build_tokenizer
from titanrush.interop import hf_convert
from titanrush.models.llama import Llama, model_args
from titanrush.models.llama.generate import KVCache, forward_cached, generate, sample
from titanrush.models.llama.model import rope_cache
from titanrush.tools import generate as generate_cmd

# Small enough for quick CPU decoding; grouped K/V heads and llama3 RoPE scaling so both paths are used.
ARGS = model_args(
    "debug",
    dim=128,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    rope_scaling=True,
    rope_original_max_len=32,
    max_seq_len=256,
)


@pytest.fixture(scope="module")
def model() -> Llama:
    return make_model(ARGS, seed=11)


def greedy_by_recomputation(model: Llama, prompt: list[int], n: int) -> list[int]:
    """The reference: the training forward over the whole sequence for every new token."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_cached_prefill_gives_the_forward_logits(model):
    tokens = torch.randint(0, ARGS.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = KVCache.empty(model, 2, 48)
    rope = rope_cache(ARGS, 48)
    with torch.no_grad():
        want = model(tokens)
        first = forward_cached(model, tokens[:, :25], cache, rope)  # a prompt, then the rest in pieces
        rest = [forward_cached(model, tokens[:, i : i + 5], cache, rope) for i in (25, 30, 35)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), want, atol=1e-5, rtol=1e-5)
    assert cache.length == 40


@pytest.mark.parametrize("prompt_len", [1, 9])
def test_kv_cached_greedy_equals_recomputing_every_step(model, prompt_len):
    prompt = torch.randint(0, ARGS.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    new = generate(model, prompt.tolist(), max_new_tokens=24)
    assert len(new) == 24
    assert new == greedy_by_recomputation(model, prompt.tolist(), 24)
    assert len(set(new)) > 1  # not a degenerate model that repeats one token


def test_eos_stops_and_max_tokens_bounds(model):
    prompt = [5, 6, 7]
    free = generate(model, prompt, max_new_tokens=10)
    assert generate(model, prompt, max_new_tokens=10, eos_id=free[3]) == free[: free.index(free[3]) + 1]
    assert generate(model, prompt, max_new_tokens=1) == free[:1]


def test_sampling_is_seeded_and_top_p_narrows_to_greedy(model):
    prompt = [1, 2, 3, 4]
    a = generate(model, prompt, max_new_tokens=16, temperature=1.0, seed=3)
    assert a == generate(model, prompt, max_new_tokens=16, temperature=1.0, seed=3)
    assert a != generate(model, prompt, max_new_tokens=16, temperature=1.0, seed=4)
    # A nucleus this small holds only the most likely token: sampling becomes greedy decoding.
    greedy = generate(model, prompt, max_new_tokens=16)
    assert generate(model, prompt, max_new_tokens=16, temperature=1.0, top_p=1e-6, seed=5) == greedy
    assert a != greedy


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = {int(sample(logits, 1.0, 0.75, torch.Generator().manual_seed(s))) for s in range(200)}
    assert seen == {0, 1}  # 0.5 < 0.75 needs the second token; the first two reach it
    seen = {int(sample(logits, 1.0, 0.85, torch.Generator().manual_seed(s))) for s in range(200)}
    assert seen == {0, 1, 2}
    assert int(sample(logits, 0.0, 0.5, None)) == 0


def checkpoint_of(model: Llama, root: Path) -> Path:
    return save_checkpoint(model, root / "run" / "checkpoint", step=3)


def test_cli_prints_prompt_and_continuation(tmp_path, model, capsys):
    ckpt = checkpoint_of(model, tmp_path)
    argv = [
        "generate",
        "--checkpoint",
        str(ckpt),
        "--prompt",
        "def main(",
        "--prompt",
        "import os",
        "--max-new-tokens",
        "12",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    tok = build_tokenizer("default")
    for text in ("def main(", "import os"):
        new = generate(model, tok.encode(text, bos=True, eos=False), max_new_tokens=12, eos_id=tok.eos_id)
        assert text + tok.decode(new) in out.out
    assert out.err.count("tokens/s") == 2
    # Sampling through the command is seeded too.
    sampled = ["--checkpoint", str(ckpt), "--prompt", "x", "--temperature", "0.8", "--top-p", "0.9"]
    assert generate_cmd.main(sampled) == 0
    first = capsys.readouterr().out
    assert generate_cmd.main(sampled) == 0
    assert capsys.readouterr().out == first


def test_cli_errors_exit_2(tmp_path, model, capsys):
    ckpt = checkpoint_of(model, tmp_path)
    assert generate_cmd.main(["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    too_long = ["--checkpoint", str(ckpt), "--prompt", "x", "--max-new-tokens", str(ARGS.max_seq_len)]
    assert generate_cmd.main(too_long) == 2
    assert "max_seq_len" in capsys.readouterr().err
    assert generate_cmd.main(["--checkpoint", str(ckpt), "--prompt", "x", "--top-p", "0"]) == 2
    assert generate_cmd.main(["--checkpoint", str(ckpt), "--prompt", "x", "--device", "gpu0"]) == 2
    capsys.readouterr()
    for bad in (
        ["--temperature", "nan"],
        ["--temperature", "inf"],
        ["--seed", str(2**70)],
        ["--seed", "-1"],
        ["--device", "meta"],
    ):
        assert generate_cmd.main(["--checkpoint", str(ckpt), "--prompt", "x", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert bad[0] in err and "Traceback" not in err, err
    assert (
        generate_cmd.main(["--checkpoint", str(ckpt), "--prompt", "x", "--top-p", "2", "--temperature", "-1"])
        == 2
    )
    err = capsys.readouterr().err  # each wrong value named, with what it must be; the right ones not
    assert "--temperature must be finite and >= 0, got -1.0; --top-p must be in (0, 1], got 2.0" in err, err
    assert "--max-new-tokens" not in err.splitlines()[-1] and "--seed" not in err.splitlines()[-1]


def test_hf_folder_loads_like_the_checkpoint(tmp_path, model):
    ckpt = checkpoint_of(model, tmp_path)
    out = hf_convert.export_hf(ckpt, tmp_path / "hf", dtype=torch.float32)
    from_hf = generate_cmd.load_model(out, torch.device("cpu"), torch.float32, 64)
    from_ckpt = generate_cmd.load_model(ckpt, torch.device("cpu"), torch.float32, 64)
    prompt = [3, 1, 4, 1, 5]
    want = generate(model, prompt, max_new_tokens=8)
    assert (
        generate(from_hf, prompt, max_new_tokens=8) == generate(from_ckpt, prompt, max_new_tokens=8) == want
    )
    tied = make_model(dataclasses.replace(ARGS, tie_embeddings=True), seed=2)
    loaded = generate_cmd.load_model(
        checkpoint_of(tied, tmp_path / "tied"), torch.device("cpu"), torch.float32, 64
    )
    assert loaded.output.weight is loaded.tok_embeddings.weight
    assert generate(loaded, prompt, max_new_tokens=8) == generate(tied, prompt, max_new_tokens=8)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_greedy_tokens_match_transformers_generate(tmp_path, tied):
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    ours = make_model(dataclasses.replace(ARGS, tie_embeddings=tied), seed=4)
    out = hf_convert.export_hf(checkpoint_of(ours, tmp_path), tmp_path / "hf", dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    tok = build_tokenizer("default")
    assert (theirs.generation_config.bos_token_id, theirs.generation_config.eos_token_id) == (
        tok.bos_id,
        tok.eos_id,
    )
    text = "def greet(name):\n    return"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tok.encode(text, bos=True, eos=False)  # the exported tokenizer puts BOS first
    with torch.no_grad():
        hf_new = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    want = hf_new[0, ids.shape[1] :].tolist()
    assert generate(ours, ids[0].tolist(), max_new_tokens=20, eos_id=tok.eos_id) == want
