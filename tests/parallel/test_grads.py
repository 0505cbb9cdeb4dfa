"""Every parameter's gradient under each mesh equals the single-process gradient (one torchrun job of 4).

grad_probe.py builds each mesh in turn, all-gathers each gradient to its full shape and compares it
with the unsharded model's on rank 0. The deviation of a parameter is max |g - g_ref| / max |g_ref|:
measured at most 8.2e-7 here (fp32 sums in another order); GRAD_RTOL = 1e-5. A gradient that is
reduced twice, missed, or summed over the wrong ranks is off by O(1).
"""

from __future__ import annotations

import json

import pytest
from harness import ROOT, failure, spawn

pytestmark = pytest.mark.parallel

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-5


def test_every_gradient_matches_on_every_mesh(tmp_path):
    out = tmp_path / "probe.json"
    res = spawn([str(ROOT / "tests" / "parallel" / "grad_probe.py"), str(out)], 4)
    assert res.returncode == 0, failure(res.args, res.stdout)
    report = json.loads(out.read_text())
    assert set(report) >= {
        "fsdp4",
        "ddp4",
        "tp4",
        "fsdp2_tp2",
        "hsdp2x2",
        "fsdp4_chunked",
    }
    # Loss parallel's own cross-entropy (uneven vocabulary shards, ignored labels, row chunks): fp32 to
    # reassociation, bf16 to its rounding of the gradient (2**-8 relative), ignored rows' gradient zero.
    for dtype, rtol in (("float32", 1e-6), ("bfloat16", 1e-2)):
        r = report.pop(f"vocab_parallel_loss_{dtype}")
        assert r["loss_dev"] <= 1e-6 and r["grad_dev"] <= rtol and r["ignored_rows_grad"] == 0, (dtype, r)
    for mesh, r in report.items():
        print(f"\ngradients {mesh}: max deviation {r['max_grad_dev']:.1e} ({r['worst']})")
        assert r["max_grad_dev"] <= GRAD_RTOL, (mesh, r)
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * r["ref_loss"], (mesh, r)
