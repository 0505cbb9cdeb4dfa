"""The README's quick start: PyTorch's build for the machine first, then the package; the torch versions
it names as tested include the one these tests run on."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Quick start") : text.index("\n## ", text.index("## Quick start") + 1)]


def test_torch_is_installed_for_the_machine_before_the_package():
    text = quick_start()
    cpu = text.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    gpu = text.index("pip install torch --index-url https://download.pytorch.org/whl/cu")
    assert max(cpu, gpu) < text.index("\npip install -e . && ./run_train.sh")


def test_the_tested_torch_versions_include_this_one():
    named = re.search(r"(\d+\.\d+) and (\d+\.\d+) are the versions it is tested on", quick_start())
    assert named, "the quick start names the torch versions it is tested on"
    this = ".".join(torch.__version__.split(".")[:2])
    assert this in named.groups(), f"the tests run on torch {torch.__version__}; the README: {named.groups()}"
