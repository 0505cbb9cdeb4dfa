"""Imported by torchtitan through `--experimental.custom_import tt_flavors` (side_by_side.py).

torchtitan 0.2.2 ships no Llama 3.2 shapes: this adds the 1B and 3B (untied output, as torchtitan builds
every Llama) to its llama3 flavors, and titanrush's Llama 4 benchmark sizes to its llama4 flavors (every
layer MoE, one shared expert, top-1 sigmoid routing, expert hidden 2816 = its auto-scaled size, the bias
step at TT_LOAD_BALANCE_COEFF, default 1e-3 as torchtitan's), so both trainers build the same models.
"""

import os

from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.models.llama4 import llama4_args
from torchtitan.models.llama4.model.args import TransformerModelArgs as Llama4Args
from torchtitan.models.moe import MoEArgs

_ARGS = dict(n_kv_heads=8, multiple_of=256, rope_theta=500000, rope_scaling_args=RoPEScalingArgs(32.0))
llama3_args["1B"] = TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5, **_ARGS)
llama3_args["3B"] = TransformerModelArgs(dim=3072, n_layers=28, n_heads=24, ffn_dim_multiplier=1.0, **_ARGS)

_COEFF = float(os.environ.get("TT_LOAD_BALANCE_COEFF", "1e-3"))
for _experts in (8, 16):
    llama4_args[f"llama4_1Bx{_experts}E"] = Llama4Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        rope_theta=5e5,
        moe_args=MoEArgs(num_experts=_experts, load_balance_coeff=_COEFF),
        interleave_moe_layer_step=1,
    )

# titanrush's debug shapes (its `debug` and `llama4_debug` flavors), for checks on the CPU. A scaling factor
# of 1 leaves torchtitan's RoPE frequencies unscaled (titanrush's debug model has no scaling).
_UNSCALED = RoPEScalingArgs(scaling_factor=1.0)
_DEBUG = dict(
    dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=64, rope_theta=500000
)
llama3_args["debug"] = TransformerModelArgs(**_DEBUG, rope_scaling_args=_UNSCALED)
llama4_args["llama4_debug"] = Llama4Args(
    **_DEBUG, moe_args=MoEArgs(num_experts=8, load_balance_coeff=_COEFF), interleave_moe_layer_step=1
)
