"""The Llama 3 model family.

The shapes (`ModelArgs`, `FLAVORS`) import without torch: the config's checks read them before torch is
imported. `Llama` (model.py, torch) is imported on first use.
"""

from titanrush.models.llama.args import ModelArgs
from titanrush.models.llama.flavors import FLAVORS, model_args

__all__ = ["FLAVORS", "Llama", "ModelArgs", "model_args"]


def __getattr__(name: str) -> object:
    if name == "Llama":
        from titanrush.models.llama.model import Llama

        return Llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
