"""The real trainer's first steps under tensor parallel, with Inductor's generated code captured.

Run under torchrun on 2 GPUs: `torchrun --nproc_per_node=2 tests/gpu/async_tp_probe.py OUT [--section.key
value ...]`. Each rank writes OUT/rank<r>.json: the logged losses, and how often the code Inductor
generated for the compiled blocks calls the fused all-gather + matmul and matmul + reduce-scatter of
async TP (symmetric memory) and the plain collectives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch._inductor.utils import run_and_get_code

from titanrush import config, distributed
from titanrush.run.plan import build_plan
from titanrush.trainer import Trainer

CALLS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter", "all_gather_into_tensor", "reduce_scatter")


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    ranks = distributed.ranks_from_env()
    cfg = config.load(None, overrides)
    trainer = Trainer(cfg, build_plan(cfg, ranks.world_size))
    losses, codes = run_and_get_code(trainer.train)
    report = {"losses": losses, **{name: sum(code.count(name) for code in codes) for name in CALLS}}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(report))
    trainer.close()


if __name__ == "__main__":
    main()
