"""What `titanrush convert --from-hf` prints: the commands that train from an import and export the result.

Each printed command runs as it stands, in the folder the import ran from: the tokenizer (the import's
own `tokenizer.json`, else one the user makes with `titanrush tokenizer` at the model's vocabulary), the
run with checkpoints on in a named run folder, and the export of that run's newest checkpoint.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from titanrush.interop import hf


def run_folder(out: Path) -> Path:
    """The run folder the hint trains into: `outputs/<import name>-train`."""
    return Path("outputs") / f"{out.name}-train"


def tokenizer_folder(out: Path) -> Path:
    """Where the hint makes a tokenizer for an import that has none: beside it, `<import>-tokenizer`."""
    return out.with_name(f"{out.name}-tokenizer")


def import_hint(out: str | Path, src: str | Path) -> str:
    """The lines `titanrush convert --from-hf SRC OUT` prints once OUT is written.

    Args:
        out: the imported checkpoint folder (as the user named it).
        src: the Hugging Face folder it came from.
    """
    out, src = Path(out), Path(src)
    flags = hf.import_command(out)
    lines = [f"wrote {out}"]
    if "--data.tokenizer" not in flags:  # the HF folder had no tokenizer.json
        vocab = hf.model_args_at(out).vocab_size
        tok = tokenizer_folder(out)
        lines += [
            f"{src} ships no tokenizer; make one of at most the model's {vocab} ids: the model's own (add "
            "--from ITS_TOKENIZER_JSON), or a new BPE learned from your text (add --input FILES; without it, "
            "the embedded corpus), whose ids mean nothing yet to the imported weights:",
            f"  titanrush tokenizer --vocab-size {vocab} --output {_q(tok)}",
        ]
        flags = [*flags, "--data.tokenizer", str(tok)]
    run = run_folder(out)
    flags += ["--checkpoint.enable", "--job.dump_folder", str(run.parent), "--job.name", run.name]
    lines += [
        "train from it (add --config FILE for your data, steps and schedule; these flags win over it):",
        f"  titanrush train {shlex.join(flags)}",
        f"then export the run's newest checkpoint (in {run / 'checkpoint'}) to a Hugging Face folder:",
        f"  titanrush convert --to-hf {_q(run / 'checkpoint')} {_q(out.with_name(f'{out.name}-hf'))}",
    ]
    return "\n".join(lines)


def _q(path: Path) -> str:
    return shlex.quote(str(path))
