"""DeepSeek-V3 in TorchTitan's style and module names: multi-head latent attention (MLA) and a
mixture of experts with shared experts and sigmoid, group-limited routing (models/common/moe.py),
the first `first_k_dense_replace` layers dense. Computes what transformers' DeepseekV3ForCausalLM
computes (tests/models/test_deepseek_v3.py); pipeline- and meta-device friendly as models/common/decoder.py.

MLA: the query is one projection (`wq`) or a low-rank one (`wq_a`, `q_norm`, `wq_b`); keys and
values come from one compressed latent (`wkv_a` -> `kv_norm` -> `wkv_b`, per head: qk_nope_head_dim
of key, v_head_dim of value) plus a rotary key of qk_rope_head_dim that `wkv_a` also makes, one
for all heads. Only the rope part of each query and key head is rotated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.core.seeding import seeded_generator

from ..common.decoder import FeedForward, Transformer, apply_rotary_emb, apply_rotary_emb_half
from ..common.moe import MoE, is_moe_layer, moe_layers

NORM_EPS_LATENT = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm: DeepseekV3RMSNorm's default


@dataclass
class DeepseekV3Args:
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = 129280
    ffn_dim: int = 18432  # the dense layers' SwiGLU width (HF intermediate_size)
    norm_eps: float = 1e-6
    max_seq_len: int = 4096  # RoPE table length
    tie_embeddings: bool = False
    # multi-head latent attention
    q_lora_rank: int = 1536  # 0: the query is one projection (no low-rank query)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # rotate (even, odd) pairs (DeepSeek's weights); False: HF's halves
    # YaRN (HF rope_parameters type yarn); None: plain RoPE
    yarn_factor: float | None = None
    yarn_original_max_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0  # with yarn_mscale_all_dim: the rotated dims' attention factor
    yarn_mscale_all_dim: float = 0.0  # nonzero: also scales the softmax by mscale(factor, this)^2
    # mixture of experts
    num_experts: int = 256  # routed experts (HF n_routed_experts)
    num_experts_per_tok: int = 8
    moe_dim: int = 2048  # one expert's hidden width (HF moe_intermediate_size)
    n_shared_experts: int = 1  # always-on experts beside the routed ones
    first_k_dense_replace: int = 3  # the first k layers are dense
    score_func: str = "sigmoid"  # sigmoid (DeepSeek-V3) | softmax (DeepSeek-V2, TorchTitan's 16B)
    n_group: int = 8  # expert groups ...
    topk_group: int = 4  # ... of which each token's top-k is drawn from its best topk_group
    routed_scaling_factor: float = 2.5  # the routed experts' weights are multiplied by it
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0  # read by the step under aux_loss only (refused here)
    load_balance: str = "aux_free"  # the correction bias routes, as transformers' always does
    bias_update_rate: float = 0.001  # DeepSeek-V3's bias update speed (gamma)
    grouped_mm: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """A query/key head's width (what FLOP counts read)."""
        return self.qk_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads  # every head its own key and value (expanded from the latent)

    @property
    def ffn_hidden_dim(self) -> int:
        return self.ffn_dim

    # is_moe_layer's terms (transformers' DeepseekV3DecoderLayer: sparse from first_k_dense_replace on)
    @property
    def mlp_only_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace))

    decoder_sparse_step = 1

    @property
    def n_moe_layers(self) -> int:
        return sum(is_moe_layer(self, i) for i in range(self.n_layers))

    def describe(self) -> str:
        """The shape on one line (the dry-run plan's `shape` row)."""
        query = f"q_lora {self.q_lora_rank}" if self.q_lora_rank else "plain q"
        rope = f"RoPE theta {self.rope_theta:g}"
        if self.yarn_factor is not None:
            rope += f" x{self.yarn_factor:g} (yarn, from {self.yarn_original_max_seq_len})"
        groups = f", top-{self.topk_group} of {self.n_group} groups" if self.n_group > 1 else ""
        return (
            f"dim {self.dim}, {self.n_layers} layers, MLA {self.n_heads} heads ({query}, kv_lora "
            f"{self.kv_lora_rank}, qk {self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v {self.v_head_dim}), "
            f"MoE in {self.n_moe_layers} layers: {self.num_experts} experts of {self.moe_dim} + "
            f"{self.n_shared_experts} shared, {self.score_func} top-{self.num_experts_per_tok}{groups} "
            f"({self.load_balance}), dense FFN {self.ffn_dim} in {self.n_layers - self.n_moe_layers}, "
            f"vocab {self.vocab_size}, eps {self.norm_eps:g}, {rope}, "
            f"{'tied' if self.tie_embeddings else 'untied'} embeddings, max_seq_len {self.max_seq_len}"
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (transformers'
        yarn_apply_mscale)."""
        scale = self.qk_head_dim**-0.5
        if self.yarn_factor is not None and self.yarn_mscale_all_dim:
            scale *= yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) ** 2
        return scale


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 mscale ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_table(a: DeepseekV3Args) -> torch.Tensor:
    """(max_seq_len, qk_rope_head_dim / 2) complex rotations, YaRN's as transformers computes them
    (frequencies blended between interpolated and extrapolated, magnitude its attention factor)."""
    dim, base = a.qk_rope_head_dim, a.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    freqs, magnitude = 1.0 / pos_freqs, 1.0
    if a.yarn_factor is not None:
        factor, old = a.yarn_factor, a.yarn_original_max_seq_len

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(a.yarn_beta_fast)), 0)
        high = min(math.ceil(correction_dim(a.yarn_beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)
        extrapolated = 1 - torch.clamp(ramp, 0, 1)  # 1: keep the frequency, 0: divide it by factor
        freqs = freqs / factor * (1 - extrapolated) + freqs * extrapolated
        if a.yarn_mscale and a.yarn_mscale_all_dim:
            magnitude = yarn_mscale(factor, a.yarn_mscale) / yarn_mscale(factor, a.yarn_mscale_all_dim)
        else:
            magnitude = yarn_mscale(factor, 1.0)
    angles = torch.outer(torch.arange(a.max_seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.full_like(angles, magnitude), angles)  # complex64


class MultiHeadLatentAttention(nn.Module):
    """MLA (module doc). Context parallelism is not wired for it (the family's check refuses cp)."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.args = args
        heads, qk = args.n_heads, args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=NORM_EPS_LATENT)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=NORM_EPS_LATENT)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(heads * args.v_head_dim, args.dim, bias=False)
        self.rope = apply_rotary_emb if args.rope_interleave else apply_rotary_emb_half

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        a = self.args
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if a.q_lora_rank else self.wq(x)
        q = q.view(bsz, seqlen, -1, a.qk_head_dim)  # (B, S, H, nope + rope); -1: H / tp under tp
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        # one rotary key for every head: (B, S, 1, rope)
        q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2), freqs_cis[:seqlen])
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)  # (B, S, H, nope), (B, S, H, v)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, .)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, S, H * v) -> (B, S, D)


class DeepseekV3Block(nn.Module):
    """MLA, then a dense SwiGLU (`feed_forward`) in the first layers or the MoE (`moe`) after."""

    def __init__(self, args: DeepseekV3Args, layer_id: int):
        super().__init__()
        self.attention = MultiHeadLatentAttention(args)
        if is_moe_layer(args, layer_id):
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class DeepseekV3Transformer(Transformer):
    rope_table = staticmethod(rope_table)
    # the router's correction bias routes in transformers' forward: read from checkpoints (HF's
    # e_score_correction_bias) with the parameters (interop/weights.py load_into)
    weight_buffers = ("expert_bias",)

    def make_block(self, args: DeepseekV3Args, layer_id: int) -> nn.Module:
        return DeepseekV3Block(args, layer_id)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        super().init_buffers(device)
        for moe in moe_layers(self).values():
            moe.expert_bias = torch.zeros_like(moe.expert_bias, device=device or moe.expert_bias.device)

    def init_param(self, fqn: str, full: torch.Tensor, seed: int) -> None:
        """Routed experts and router as Qwen3-MoE's (TorchTitan's draw); everything else, the
        shared experts and MLA's projections included, as the shared decoder's."""
        if ".moe.experts." not in fqn and ".moe.router." not in fqn:
            return super().init_param(fqn, full, seed)
        layer_id = int(fqn.split(".")[1])
        depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        std = depth_std if fqn.endswith(("experts.w2", "experts.w3")) else 0.02
        nn.init.trunc_normal_(full, std=std, generator=seeded_generator(seed, fqn))
