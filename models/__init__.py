"""meshforge.models: TorchTitan-style transformers and the registry of their shapes."""

from .llama import LlamaArgs, Transformer, count_params
from .registry import MODELS, args_from_config, get_model_spec, model_args

__all__ = ["LlamaArgs", "Transformer", "count_params", "MODELS", "get_model_spec", "model_args", "args_from_config"]
