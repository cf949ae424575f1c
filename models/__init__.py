"""Flax NNX model zoo for jcxl's tests and experiments.

One module per family (``gpt2``, ``llama``, ``vit``, ``mlp``), each with a
frozen config dataclass, presets and ``make_loss(config)``; ``common`` holds
the shared layers and the functional interface (``functional``,
``pure_params``, ``count_params``, ``stack_layers``).
"""

from models import common as common
from models import gpt2 as gpt2
from models import llama as llama
from models import mlp as mlp
from models import vit as vit

__all__ = ["common", "gpt2", "llama", "mlp", "vit"]
