"""Samples rank 0's start-up with py-spy (diagnostics for the time to first step, both trainers alike).

Put this folder first on PYTHONPATH and set STARTUP_PROFILE_DIR (and PY_SPY, the py-spy binary): every
Python process started with RANK=0 and a trainer's config argument (titanrush's `--config`, torchtitan's
`--job.config_file`) then has py-spy record its threads, idle ones included, until it exits (at most
STARTUP_PROFILE_S seconds, default 90), into STARTUP_PROFILE_DIR/pyspy_<pid>.json (speedscope's format: each
thread's samples in order) with the arguments beside it (`.argv`). The compile workers
and flash-attn-4's warm-up child (other arguments) are not sampled. `summarize.py` reads the files.
"""

import os
import sys


def _start() -> None:
    out, spy = os.environ.get("STARTUP_PROFILE_DIR"), os.environ.get("PY_SPY")
    argv = sys.argv
    if not out or not spy or os.environ.get("RANK") != "0" or "--flash-warm-up" in argv:
        return
    if "--config" not in argv and "--job.config_file" not in argv:
        return
    import contextlib
    import ctypes
    import subprocess

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"pyspy_{os.getpid()}")
    with open(path + ".argv", "w") as f:
        f.write(" ".join(argv) + "\n")
    with contextlib.suppress(OSError, AttributeError):  # a child may trace this process (Yama scope 1)
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    seconds = os.environ.get("STARTUP_PROFILE_S", "90")
    cmd = [spy, "record", "--pid", str(os.getpid()), "--idle", "--threads", "--nonblocking", "-r", "100",
           "-d", seconds, "--format", "speedscope", "-o", path + ".json"]  # fmt: skip
    with open(path + ".log", "w") as log:
        subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


_start()
