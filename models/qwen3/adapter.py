"""Qwen3's weights in other formats: HuggingFace `Qwen3ForCausalLM` and MaxText's qwen3 decoder
block. Qwen3 rotates (i, i + head_dim/2) pairs, as HF and MaxText do, so no rows are permuted:
names only. TorchTitan's dense Qwen3 flavors are not imported (its MoE ones are: qwen3_moe)."""

from __future__ import annotations

from typing import Any

from meshforge.core.errors import IncompatibleWeights

from ..common.adapter import StateDictAdapter
from ..common.hf_config import decoder_args, decoder_config, expect, refuse
from ..common.hf_names import DECODER_LAYER, HFNames
from .model import Qwen3Args

FAMILY = "qwen3"
HF_LAYER = {
    **DECODER_LAYER,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
SLIDING_WINDOW_KEYS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


def hf_permuted_heads(name: str, args: Any) -> None:
    """Qwen3's HF rows are in our order: nothing is permuted."""
    return None


def refuse_sliding_windows(cfg: dict) -> None:
    """Sliding-window attention (any layer of it) is refused: only full attention is implemented."""
    expect(cfg, "use_sliding_window", (False,), "sliding-window attention is not implemented")
    if set(cfg.get("layer_types") or ["full_attention"]) != {"full_attention"}:
        raise refuse("layer_types", cfg["layer_types"], "only full-attention layers are implemented")


class Qwen3Adapter(StateDictAdapter):
    names = HFNames(HF_LAYER, hf_permuted_heads, "Qwen3")
    hf_model_type = "qwen3"
    maxtext_qk_norm = True

    def hf_config(self, args: Qwen3Args, dtype: str = "float32") -> dict:
        """config.json of the equivalent HF Qwen3ForCausalLM."""
        return decoder_config(args, "Qwen3ForCausalLM", self.hf_model_type, dtype, use_sliding_window=False)

    def args_from_hf_config(self, cfg: dict) -> Qwen3Args:
        """Qwen3Args of an HF Qwen3 config.json (transformers 4 or 5 format); every key that
        would change the math and that we do not implement is refused."""
        fields = decoder_args(
            cfg, FAMILY, self.hf_model_type, SLIDING_WINDOW_KEYS, default_max_positions=32768
        )
        refuse_sliding_windows(cfg)
        return Qwen3Args(**fields, head_dim=cfg.get("head_dim") or fields["dim"] // fields["n_heads"])

    def maxtext_block(self, args: Qwen3Args) -> dict[str, Any]:
        """MaxText's qwen3 block: q/k norms, a plain rotary over rotate-half pairs (as ours)."""
        if args.rope_scaling_factor is not None:
            raise IncompatibleWeights(
                f"rope_scaling_factor={args.rope_scaling_factor}: MaxText's Qwen3 rotary has no Llama 3 "
                "scaling; set it to null"
            )
        return {"decoder_block": "qwen3", "use_qk_norm": True, "normalize_embedding_logits": False}


ADAPTER = Qwen3Adapter()
