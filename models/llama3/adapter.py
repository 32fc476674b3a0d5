"""The Llama family's weight formats: HuggingFace `LlamaForCausalLM` and TorchTitan names.

Our parameter names are TorchTitan's classic Llama 3 names (TorchTitan 0.3.0 saves
`attention.qkv_linear.wq.weight` and `lm_head.weight`: models/common/hf_names.py). HuggingFace
rotates q and k by halves (rotate_half) where Meta/TorchTitan rotate interleaved pairs, so
the rows of wq and wk are permuted per head on the way to HF and back (as HF's own
convert_llama_weights_to_hf does). Registered as the family's `interop` (models/spec.py).
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
)
from meshforge.models.common.hf_names import (
    DECODER_LAYER,
    HFNames,
    from_torchtitan,
    load_hf_state,
    name_from_torchtitan,
    name_to_torchtitan,
    permute_from_hf,
    permute_to_hf,
    save_hf_state,
    to_torchtitan,
)

from .model import LlamaArgs

# re-exported: the family's interop interface (models/spec.py)
__all__ = [
    "check_compatible",
    "from_torchtitan",
    "name_from_torchtitan",
    "name_to_torchtitan",
    "permute_from_hf",
    "permute_to_hf",
    "to_torchtitan",
]

HF_LAYER = DECODER_LAYER  # ours -> HF, within a block
HF_MODEL_TYPE = "llama"


def hf_permuted_heads(name: str, args: LlamaArgs) -> int | None:
    """How many heads `name`'s rows are permuted by in HF's layout (None: not permuted)."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


NAMES = HFNames(HF_LAYER, hf_permuted_heads, "Llama")
hf_name, to_hf, from_hf, source_name, tensor_to_hf = (
    NAMES.hf_name,
    NAMES.to_hf,
    NAMES.from_hf,
    NAMES.source_name,
    NAMES.tensor_to_hf,
)


def hf_config(args: LlamaArgs, dtype: str = "float32") -> dict:
    """config.json of the equivalent HF LlamaForCausalLM."""
    return decoder_config(args, "LlamaForCausalLM", HF_MODEL_TYPE, dtype, mlp_bias=False)


def args_from_hf_config(cfg: dict) -> LlamaArgs:
    """LlamaArgs of an HF Llama config.json (transformers 4 or 5 format); every key that
    would change the math and that we do not implement is refused."""
    fields = decoder_args(cfg, "llama3", HF_MODEL_TYPE, {"mlp_bias"}, default_max_positions=2048)
    expect(cfg, "mlp_bias", (False,), "FFN projections with biases are not implemented")
    fixed = fields["dim"] // fields["n_heads"]
    expect(
        cfg,
        "head_dim",
        (fixed,),
        f"Llama fixes head_dim = hidden_size / num_attention_heads = {fixed}; "
        "another head_dim is not implemented",
    )
    return LlamaArgs(**fields)


def read_hf_args(folder: Path) -> LlamaArgs:
    """The args of the HF folder's config.json."""
    return args_from_hf_config(read_config(folder))


def save_hf(state: dict[str, torch.Tensor], args: LlamaArgs, out: Path, **kw) -> list:
    """An HF folder: config.json + safetensors (sharded with an index when large)."""
    return save_hf_state(NAMES, hf_config, state, args, out, **kw)


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
    """Our state dict and args from an HF folder (one or several safetensors files)."""
    return load_hf_state(NAMES, read_hf_args, folder)
