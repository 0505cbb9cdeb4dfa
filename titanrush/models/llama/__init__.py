"""The Llama 3 model family."""

from titanrush.models.llama.flavors import FLAVORS, model_args
from titanrush.models.llama.model import Llama, ModelArgs

__all__ = ["FLAVORS", "Llama", "ModelArgs", "model_args"]
