"""`titanrush generate`: continue a prompt with a checkpoint's model, to see what it has learned.

    titanrush generate --checkpoint DIR --prompt TEXT [--prompt TEXT ...] [--max-new-tokens 64]
                       [--temperature 0] [--top-p 1.0] [--seed 0] [--tokenizer SPEC]
                       [--device auto|cpu|cuda] [--dtype auto|fp32|bf16|fp16] [--no-bos]

DIR is a titanrush checkpoint (a `step-<N>` folder, its checkpoint folder, or a `convert --from-hf`
output) or a Hugging Face Llama folder. The model runs on one device (a GPU when there is one) with a KV
cache (`titanrush.models.llama.generate`). Temperature 0 decodes greedily; above 0 it samples, from the
top-p nucleus, seeded. Each prompt is printed with its continuation, which ends at EOS or after
--max-new-tokens. Exit status: 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from titanrush.config import ConfigError
from titanrush.data.tokenizer import HFTokenizer, Tokenizer, build_tokenizer
from titanrush.interop import hf
from titanrush.interop.pruned import newest_kept
from titanrush.models.llama import Llama, ModelArgs
from titanrush.models.llama.generate import generate
from titanrush.models.llama.model import rope_cache
from titanrush.models.llama4 import Llama4Args


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(prog="titanrush generate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="titanrush checkpoint or HF folder")
    p.add_argument("--prompt", action="append", required=True, help="text to continue (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="the most tokens to add (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: keep the top-p nucleus (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help="data.tokenizer's syntax; default: the checkpoint's (its tokenizer.json, or the run's config)",
    )
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(hf.DTYPES)], help="auto: bf16 on GPU")
    p.add_argument("--no-bos", action="store_true", help="do not put BOS before the prompt")
    return p


def _dense(folder: Path, is_hf: bool) -> ModelArgs:
    """The model arguments of a titanrush checkpoint or Hugging Face folder, refused for Llama 4."""
    args = hf.model_args_at(folder)
    if isinstance(args, Llama4Args):
        how = "" if is_hf else "export it (`titanrush convert --to-hf`) and "
        raise ConfigError(
            f"{folder} holds a Llama 4 (mixture-of-experts) model; generate takes dense Llamas only: {how}"
            "generate with transformers' Llama4ForCausalLM"
        )
    return args


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype, max_len: int) -> Llama:
    """The whole model of a titanrush checkpoint or an HF Llama folder, on device, in dtype, in eval mode.

    max_len: the longest sequence it will see (the RoPE table's length).
    """
    folder, is_hf = hf.weights_folder(path)
    args = _dense(folder, is_hf)  # (before any weight is read)
    if is_hf:
        sd = hf.from_hf_state_dict(hf.load_hf_weights(folder), args)
    else:
        sd, args, _ = hf.read_checkpoint(folder)
    args = dataclasses.replace(args, rope_positions=max_len)
    moved: dict[int, torch.Tensor] = {}  # by tensor: a tied embedding is moved once
    for v in sd.values():
        if id(v) not in moved:
            moved[id(v)] = v.to(device=device, dtype=dtype)
    sd = {k: moved[id(v)] for k, v in sd.items()}
    with torch.device("meta"):
        model = Llama(args)
    model.load_state_dict(sd, assign=True)  # the parameters become these tensors: no second copy
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    # The RoPE table is a buffer, not in the state dict.
    model.rope = rope_cache(args, args.rope_len).to(device)
    return model.eval()


def _prepare(
    ns: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[Tokenizer | HFTokenizer, list[list[int]], Llama]:
    """(the tokenizer, the prompts' ids, the model) of the checkpoint or HF folder --checkpoint names."""
    folder, is_hf = hf.weights_folder(ns.checkpoint)  # (what the path is, before anything is read)
    spec = ns.tokenizer or hf.training_tokenizer(folder)
    tok = build_tokenizer(spec)
    prompts = [tok.encode(p, bos=not ns.no_bos, eos=False) for p in ns.prompt]
    args = _dense(folder, is_hf)
    if tok.n_words > args.vocab_size:
        raise ConfigError(
            f"tokenizer {spec!r} has {tok.n_words} ids, the model only {args.vocab_size}: pass the one "
            "it was trained with (--tokenizer)"
        )
    longest = max(len(p) for p in prompts) + ns.max_new_tokens
    if longest > args.max_seq_len:
        raise ConfigError(
            f"the longest prompt ({longest - ns.max_new_tokens} tokens) + --max-new-tokens "
            f"{ns.max_new_tokens} exceeds the model's max_seq_len {args.max_seq_len}"
        )
    if any(not p for p in prompts):
        raise ConfigError("an empty --prompt with --no-bos has no token to start from")
    return tok, prompts, load_model(folder, device, dtype, longest)


def main(argv: list[str] | None = None) -> int:
    """Generate a continuation of every prompt; return the exit status."""
    parser = build_parser()
    try:
        ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
        rules = [
            (ns.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {ns.max_new_tokens}"),
            (0 <= ns.temperature < math.inf, f"--temperature must be finite and >= 0, got {ns.temperature}"),
            (0 < ns.top_p <= 1, f"--top-p must be in (0, 1], got {ns.top_p}"),
            (0 <= ns.seed < 2**63, f"--seed must be in [0, 2**63), got {ns.seed}"),
        ]
        wrong = [text for ok, text in rules if not ok]
        if wrong:
            parser.error("; ".join(wrong))
    except SystemExit as e:  # --help or a usage error: argparse has printed it
        return int(e.code or 0)
    try:
        cuda = torch.cuda.is_available()
        try:
            device = torch.device(("cuda" if cuda else "cpu") if ns.device == "auto" else ns.device)
        except RuntimeError:
            raise ConfigError(
                f"--device {ns.device!r} is not a device: use auto, cpu, cuda or cuda:N"
            ) from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device {ns.device}: generate runs on cpu or cuda")
        if device.type == "cuda" and not cuda:
            raise ConfigError(f"--device {ns.device}: no CUDA GPU here; use --device cpu")
        on_gpu = torch.bfloat16 if device.type == "cuda" else torch.float32
        dtype = hf.DTYPES[ns.dtype] if ns.dtype != "auto" else on_gpu
        # (a checkpoint folder's newest step, again where its run prunes that step while it is read)
        tok, prompts, model = newest_kept(ns.checkpoint, lambda: _prepare(ns, device, dtype))
    except ConfigError as e:
        print(f"titanrush generate: error: {e}", file=sys.stderr)
        return 2
    for text, ids in zip(ns.prompt, prompts):
        t0 = time.perf_counter()
        new = generate(
            model,
            ids,
            max_new_tokens=ns.max_new_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            eos_id=tok.eos_id,
            seed=ns.seed,
        )
        seconds = time.perf_counter() - t0
        shown = new[:-1] if new and new[-1] == tok.eos_id else new
        print(text + tok.decode(shown), flush=True)
        print("", flush=True)
        end = "EOS" if len(shown) < len(new) else "max tokens"
        print(f"[{len(new)} tokens, {len(new) / seconds:.1f} tokens/s, stopped at {end}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
