"""Llama 3's weights in other formats: HuggingFace `LlamaForCausalLM`, TorchTitan's llama3 names
and flavors, and MaxText's llama2 decoder block with its llama3.1 rotary.

Our parameter names are TorchTitan's classic Llama 3 names (TorchTitan 0.3.0 saves
`attention.qkv_linear.wq.weight` and `lm_head.weight`: models/common/hf_names.py). HuggingFace
rotates q and k by halves (rotate_half) where Meta/TorchTitan rotate interleaved pairs, so
the rows of wq and wk are permuted per head on the way to HF and back (as HF's own
convert_llama_weights_to_hf does).
"""

from __future__ import annotations

from typing import Any

from meshforge.core.errors import IncompatibleWeights

from ..common.adapter import StateDictAdapter
from ..common.hf_config import decoder_args, decoder_config, expect
from ..common.hf_names import DECODER_LAYER, HFNames
from .model import LlamaArgs

FAMILY = "llama3"
MAXTEXT_ROPE = (8.0, 1.0, 4.0, 8192)  # what MaxText's llama3.1 rotary applies, whatever the config says

# TorchTitan 0.2's Llama 3 flavors over its TransformerModelArgs defaults, in meshforge's names
# (every flavor applies Llama 3.1 RoPE scaling: factor 8 from an original context of 8192)
_TORCHTITAN_ARGS = dict(
    vocab_size=128256,
    multiple_of=256,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling_factor=8.0,
    rope_original_max_seq_len=8192,
)
TORCHTITAN_FLAVORS = {
    "debugmodel": dict(
        _TORCHTITAN_ARGS, dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, rope_theta=500000.0
    ),
    "8B": dict(
        _TORCHTITAN_ARGS,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000.0,
    ),
    "70B": dict(
        _TORCHTITAN_ARGS,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
    ),
    "405B": dict(
        _TORCHTITAN_ARGS,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000.0,
    ),
}


def hf_permuted_heads(name: str, args: LlamaArgs) -> int | None:
    """How many heads `name`'s rows are permuted by in HF's layout (None: not permuted)."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


class Llama3Adapter(StateDictAdapter):
    names = HFNames(DECODER_LAYER, hf_permuted_heads, "Llama")
    hf_model_type = "llama"
    torchtitan_model = "llama3"
    torchtitan_flavors = TORCHTITAN_FLAVORS
    maxtext_query_scaled = True  # MaxText folds the attention scale into the query kernel

    def hf_config(self, args: LlamaArgs, dtype: str = "float32") -> dict:
        """config.json of the equivalent HF LlamaForCausalLM."""
        return decoder_config(args, "LlamaForCausalLM", self.hf_model_type, dtype, mlp_bias=False)

    def args_from_hf_config(self, cfg: dict) -> LlamaArgs:
        """LlamaArgs of an HF Llama config.json (transformers 4 or 5 format); every key that
        would change the math and that we do not implement is refused."""
        fields = decoder_args(cfg, FAMILY, self.hf_model_type, {"mlp_bias"}, default_max_positions=2048)
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

    def maxtext_block(self, args: LlamaArgs) -> dict[str, Any]:
        """MaxText's llama2 block with its llama3.1 rotary (interleaved pairs, as ours), whose
        scaling factors are fixed in MaxText's code: any other scaling is refused."""
        own = (
            args.rope_scaling_factor,
            args.rope_low_freq_factor,
            args.rope_high_freq_factor,
            args.rope_original_max_seq_len,
        )
        if args.rope_scaling_factor is not None and own != MAXTEXT_ROPE:
            raise IncompatibleWeights(
                f"RoPE scaling (factor, low, high, original length) = {own}: MaxText's llama3.1 rotary "
                f"applies {MAXTEXT_ROPE} whatever its config says, so its logits would differ; export a "
                "model with those or with rope_scaling_factor=null"
            )
        return {
            "decoder_block": "llama2",
            "rope_type": "llama3.1",
            "rope_use_scale": args.rope_scaling_factor is not None,
        }


ADAPTER = Llama3Adapter()
