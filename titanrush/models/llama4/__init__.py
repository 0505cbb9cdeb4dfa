"""Llama 4: mixture-of-experts Llama (routed + shared experts, top-k sigmoid routing, iRoPE options).

The shapes (`Llama4Args`, `FLAVORS`) import without torch; `Llama4` (model.py) is imported on first use.
"""

from titanrush.models.llama4.args import Llama4Args
from titanrush.models.llama4.flavors import FLAVORS, model_args

__all__ = ["FLAVORS", "Llama4", "Llama4Args", "model_args"]


def __getattr__(name: str) -> object:
    if name == "Llama4":
        from titanrush.models.llama4.model import Llama4

        return Llama4
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
