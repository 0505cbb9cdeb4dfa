"""Python bytecode kept between launches where the installed packages have none (stdlib only: it runs
before torch is imported).

Python compiles each module's source at import unless a current `.pyc` lies in the `__pycache__` beside
it. Where packages were installed without bytecode and PYTHONDONTWRITEBYTECODE is set (container
images: the project's GPU machines are so), every process compiles torch's sources again: 5-7 s of each
rank's launch there, and as much again in each compile worker and in flash-attn-4's warm-up child.
`enable()` then has this process and its children write and read bytecode under a folder of titanrush's
own (never beside the packages' sources): a launch compiles what no earlier one did.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

VARIABLE = "TITANRUSH_PYCACHE"  # the folder, or "off"; default ~/.cache/titanrush/pycache


def installed_bytecode_usable(module: str = "torch") -> bool:
    """Whether `module`'s package (located, not imported) has bytecode Python will use or write."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True  # nothing to compile (absent, or an extension module)
    pyc = Path(importlib.util.cache_from_source(spec.origin))
    try:
        with open(pyc, "rb") as f:
            header = f.read(16)
        source = os.stat(spec.origin)
    except OSError:
        header = b""
    if len(header) == 16 and header[:4] == importlib.util.MAGIC_NUMBER:
        flags = int.from_bytes(header[4:8], "little")
        if flags & 1:  # hash-based: current unless checked against a source that changed
            return not flags & 2 or header[8:16] == importlib.util.source_hash(Path(spec.origin).read_bytes())
        mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
        if mtime == int(source.st_mtime) & 0xFFFFFFFF and size == source.st_size & 0xFFFFFFFF:
            return True
    folder = pyc.parent if pyc.parent.exists() else pyc.parent.parent
    return not sys.dont_write_bytecode and os.access(folder, os.W_OK)  # Python writes it at first import


def enable(module: str = "torch") -> Path | None:
    """Bytecode under titanrush's folder (TITANRUSH_PYCACHE) for this process and the processes it starts,
    where torch's installed bytecode is unusable and the user chose no folder (PYTHONPYCACHEPREFIX).
    Returns the folder, or None where Python's own arrangement stands."""
    choice = os.environ.get(VARIABLE, "")
    if choice == "off" or sys.pycache_prefix is not None or installed_bytecode_usable(module):
        return None
    try:
        folder = Path(choice or Path.home() / ".cache" / "titanrush" / "pycache").expanduser().resolve()
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as e:  # (an unwritable folder, or no home folder)
        fix = f"set {VARIABLE} to a writable folder, or to off; meanwhile each launch compiles torch"
        print(f"titanrush: warning: no bytecode folder ({type(e).__name__}: {e}); {fix}", file=sys.stderr)
        return None
    sys.pycache_prefix, sys.dont_write_bytecode = str(folder), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)  # the compile workers and the warm-up child
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder


if __name__ == "__main__":  # run_train.sh: the folder for the launcher (torchrun imports torch too)
    print(enable() or "")
