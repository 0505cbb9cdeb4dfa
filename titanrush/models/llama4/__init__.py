"""Llama 4: mixture-of-experts Llama (routed + shared experts, top-k sigmoid routing, iRoPE options)."""

from titanrush.models.llama4.flavors import FLAVORS, model_args
from titanrush.models.llama4.model import Llama4, Llama4Args

__all__ = ["FLAVORS", "Llama4", "Llama4Args", "model_args"]
