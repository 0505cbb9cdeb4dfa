"""Imported by torchtitan through `--experimental.custom_import tt_flavors` (scripts/side_by_side.py).

torchtitan 0.2.2 ships no 1B Llama; this adds the Llama 3.2 1B shape (untied output projection, as in
torchtitan's reference figures) to its llama3 flavors so both trainers build the same model.
"""

from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs

llama3_args["1B"] = TransformerModelArgs(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim_multiplier=1.5,
    multiple_of=256,
    rope_theta=500000,
)

# Memory snapshots (side_by_side.py --memory-snapshot): record Python stacks only, as titanrush does, so
# both trainers pay the same recording cost and the dump does not symbolize C++ frames for minutes.
import functools  # noqa: E402

import torch  # noqa: E402

torch.cuda.memory._record_memory_history = functools.partial(
    torch.cuda.memory._record_memory_history, stacks="python"
)
