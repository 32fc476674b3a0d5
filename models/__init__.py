"""meshforge.models: TorchTitan-style transformers, each family registered with everything
about itself (models/spec.py), and the registry of their shapes."""

from .llama import LlamaArgs, Transformer, count_params
from .registry import MODELS, args_from_config, get_model_spec, model_args, spec_of
from .spec import ModelSpec

__all__ = [
    "LlamaArgs",
    "ModelSpec",
    "Transformer",
    "count_params",
    "MODELS",
    "get_model_spec",
    "model_args",
    "args_from_config",
    "spec_of",
]
