"""The Qwen3 family's weight formats: HuggingFace `Qwen3ForCausalLM` and TorchTitan names.

Qwen3 rotates (i, i + head_dim/2) pairs, as HF does, so no rows are permuted: names only.
Registered as the family's `interop` (models/spec.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshforge.models.common.hf_config import (
    check_compatible,
    decoder_args,
    decoder_config,
    expect,
    read_config,
    refuse,
)
from meshforge.models.common.hf_names import (
    DECODER_LAYER,
    HFNames,
    from_torchtitan,
    load_hf_state,
    name_from_torchtitan,
    name_to_torchtitan,
    permute_from_hf,
    save_hf_state,
    to_torchtitan,
)

from .model import Qwen3Args

# re-exported: the family's interop interface (models/spec.py)
__all__ = [
    "check_compatible",
    "from_torchtitan",
    "name_from_torchtitan",
    "name_to_torchtitan",
    "permute_from_hf",
    "to_torchtitan",
]

HF_LAYER = {
    **DECODER_LAYER,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
HF_MODEL_TYPE = "qwen3"


def hf_permuted_heads(name: str, args: Qwen3Args) -> None:
    """Qwen3's HF rows are in our order: nothing is permuted."""
    return None


NAMES = HFNames(HF_LAYER, hf_permuted_heads, "Qwen3")
hf_name, to_hf, from_hf, source_name, tensor_to_hf = (
    NAMES.hf_name,
    NAMES.to_hf,
    NAMES.from_hf,
    NAMES.source_name,
    NAMES.tensor_to_hf,
)


def hf_config(args: Qwen3Args, dtype: str = "float32") -> dict:
    """config.json of the equivalent HF Qwen3ForCausalLM."""
    return decoder_config(args, "Qwen3ForCausalLM", HF_MODEL_TYPE, dtype, use_sliding_window=False)


def args_from_hf_config(cfg: dict) -> Qwen3Args:
    """Qwen3Args of an HF Qwen3 config.json (transformers 4 or 5 format); every key that
    would change the math and that we do not implement is refused."""
    extra = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
    fields = decoder_args(cfg, "qwen3", HF_MODEL_TYPE, extra, default_max_positions=32768)
    expect(cfg, "use_sliding_window", (False,), "sliding-window attention is not implemented")
    if set(cfg.get("layer_types") or ["full_attention"]) != {"full_attention"}:
        raise refuse("layer_types", cfg["layer_types"], "only full-attention layers are implemented")
    return Qwen3Args(**fields, head_dim=cfg.get("head_dim") or fields["dim"] // fields["n_heads"])


def read_hf_args(folder: Path) -> Qwen3Args:
    """The args of the HF folder's config.json."""
    return args_from_hf_config(read_config(folder))


def save_hf(state: dict[str, torch.Tensor], args: Qwen3Args, out: Path, **kw) -> list:
    """An HF folder: config.json + safetensors (sharded with an index when large)."""
    return save_hf_state(NAMES, hf_config, state, args, out, **kw)


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], Qwen3Args]:
    """Our state dict and args from an HF folder (one or several safetensors files)."""
    return load_hf_state(NAMES, read_hf_args, folder)
