"""The toy family's weights in HF's layout (model_type "toy_decoder"): the shared decoder's names,
rows in our order (rotate-half RoPE, as HF's)."""

from __future__ import annotations

from meshforge.models.common.adapter import StateDictAdapter
from meshforge.models.common.hf_config import decoder_args, decoder_config
from meshforge.models.common.hf_names import DECODER_LAYER, HFNames

from .model import ToyArgs


class ToyAdapter(StateDictAdapter):
    names = HFNames(DECODER_LAYER, lambda name, args: None, "Toy")
    hf_model_type = "toy_decoder"

    def hf_config(self, args: ToyArgs, dtype: str = "float32") -> dict:
        return decoder_config(args, "ToyForCausalLM", self.hf_model_type, dtype)

    def args_from_hf_config(self, cfg: dict) -> ToyArgs:
        fields = decoder_args(cfg, "toy", self.hf_model_type, set(), default_max_positions=256)
        return ToyArgs(**fields, head_dim=cfg["head_dim"])


ADAPTER = ToyAdapter()
