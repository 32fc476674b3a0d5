"""Qwen3-MoE in TorchTitan's style and module names: Qwen3's attention (QK-norm) with a mixture-
of-experts feed-forward (`layers.N.moe`: router, grouped experts) in the sparse layers, and a
SwiGLU `feed_forward` in the rest (`mlp_only_layers`, `decoder_sparse_step`, as transformers
decides). Pipeline- and meta-device friendly exactly as models/common/decoder.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshforge.core.seeding import seeded_generator

from ..common.decoder import TransformerBlock
from ..common.moe import MoE, is_moe_layer, moe_layers
from ..qwen3.model import Qwen3Args, Qwen3Attention, Qwen3Transformer


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    num_experts: int = 128
    num_experts_per_tok: int = 8  # top-k
    moe_dim: int = 768  # one expert's hidden width (HF moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to one
    decoder_sparse_step: int = 1  # every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # dense layers whatever the step says
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight (aux_loss balancing)
    load_balance: str = "aux_loss"  # aux_loss | aux_free (DeepSeek-V3's bias, no loss term)
    bias_update_rate: float = 0.001  # aux_free: how far the bias moves per step
    grouped_mm: bool = True  # F.grouped_mm for the experts; False: a loop over experts

    @property
    def n_moe_layers(self) -> int:
        return sum(is_moe_layer(self, i) for i in range(self.n_layers))


class MoEBlock(TransformerBlock):
    """A Qwen3 block whose feed-forward is a mixture of experts (`moe` instead of `feed_forward`)."""

    def __init__(self, args: Qwen3MoeArgs):
        super().__init__(args, Qwen3Attention)
        del self.feed_forward
        self.moe = MoE(args)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.moe(self.ffn_norm(h))


class Qwen3MoeTransformer(Qwen3Transformer):
    def make_block(self, args: Qwen3MoeArgs, layer_id: int) -> nn.Module:
        return MoEBlock(args) if is_moe_layer(args, layer_id) else super().make_block(args, layer_id)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        super().init_buffers(device)
        for moe in moe_layers(self).values():
            moe.expert_bias = torch.zeros_like(moe.expert_bias, device=device or moe.expert_bias.device)

    def init_param(self, fqn: str, full: torch.Tensor, seed: int) -> None:
        """Experts as TorchTitan draws them (w1 at 0.02, w2 and w3 depth-scaled, every expert its
        own draw of the full (E, out, in) tensor); the router gate at 0.02."""
        if ".moe." not in fqn:
            return super().init_param(fqn, full, seed)
        layer_id = int(fqn.split(".")[1])
        depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        std = depth_std if fqn.endswith(("experts.w2", "experts.w3")) else 0.02
        nn.init.trunc_normal_(full, std=std, generator=seeded_generator(seed, fqn))
