"""`titanrush convert`: checkpoints to and from Hugging Face Llama folders, and to a single `.pt` file.

    titanrush convert --to-hf CKPT_DIR OUT_DIR [--dtype bf16|fp32|fp16] [--tokenizer SPEC|none]
    titanrush convert --to-pt CKPT_DIR OUT.pt [--dtype fp32|bf16|fp16]
    titanrush convert --from-hf HF_DIR OUT_CKPT_DIR

CKPT_DIR is a `.../checkpoint/step-<N>` folder (or its checkpoint folder: the newest step); OUT.pt that is
an existing folder or ends with `/` gets `model.pt` in it. Exit status: 0 on success, 2 on bad input (a
missing folder, a file or a run folder where a checkpoint folder goes, a non-Llama config, a weight file
that is truncated or corrupt, missing tensors), with one line that names the file and the fix.
"""

from __future__ import annotations

import argparse
import sys

from titanrush.config import ConfigError
from titanrush.interop import hf, hf_convert
from titanrush.tools.import_hint import import_hint


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one of --to-hf, --to-pt, --from-hf)."""
    p = argparse.ArgumentParser(
        prog="titanrush convert",
        description="Convert checkpoints: titanrush DCP <-> Hugging Face Llama and Llama 4 (safetensors), "
        "DCP -> .pt.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-hf", nargs=2, metavar=("CKPT_DIR", "OUT_DIR"), help="export an HF Llama folder")
    mode.add_argument(
        "--to-pt",
        nargs=2,
        metavar=("CKPT_DIR", "OUT_PT"),
        help="export one .pt state dict (OUT_PT an existing folder or ending with /: OUT_PT/model.pt)",
    )
    mode.add_argument("--from-hf", nargs=2, metavar=("HF_DIR", "OUT_CKPT_DIR"), help="import an HF Llama")
    p.add_argument(
        "--dtype", choices=sorted(hf.DTYPES), help="export dtype (default: bf16 for HF, fp32 for .pt)"
    )
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help="--to-hf: the tokenizer to export (data.tokenizer's syntax: default, a rank file, a "
        "tokenizer.json), or none; default: the one the checkpoint's run trained with",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one conversion; return the exit status."""
    parser = build_parser()
    try:
        ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if ns.from_hf and ns.dtype:
            parser.error("--dtype applies to exports; --from-hf always writes float32")
        if ns.tokenizer is not None and not ns.to_hf:
            parser.error("--tokenizer applies to --to-hf (an import carries the HF folder's tokenizer files)")
    except SystemExit as e:  # --help or a usage error: argparse has printed it
        return int(e.code or 0)
    try:
        if ns.to_hf:
            tokenizer = "auto" if ns.tokenizer is None else None if ns.tokenizer == "none" else ns.tokenizer
            out = hf_convert.export_hf(*ns.to_hf, dtype=hf.DTYPES[ns.dtype or "bf16"], tokenizer=tokenizer)
            names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
            print(f"wrote {out}: {', '.join(names)}")
            if hf.BIAS_FILE in names:
                print(
                    "note: the model routes by learned biases (load balance), which Hugging Face's Llama 4 "
                    f"has no place for: they are in {hf.BIAS_FILE}, which `titanrush convert --from-hf` "
                    "takes back; transformers routes without them, so its outputs differ where a bias "
                    "changes a choice"
                )
        elif ns.to_pt:
            out = hf_convert.export_pt(*ns.to_pt, dtype=hf.DTYPES[ns.dtype or "fp32"])
            print(f"wrote {out}")
        else:
            out = hf_convert.import_hf(*ns.from_hf)
            print(import_hint(out, ns.from_hf[0]))
    except ConfigError as e:
        print(f"titanrush convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from titanrush.cli import exit_program

    exit_program(main)
