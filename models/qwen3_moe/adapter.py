"""Qwen3-MoE's weights in other formats: HuggingFace `Qwen3MoeForCausalLM`, TorchTitan's qwen3
MoE names and flavors (MaxText: none, its decoder here is dense only).

Attention, norms and the dense layers' MLP are named as Qwen3's (models/qwen3/adapter.py). The router
is `mlp.gate.weight`. Our experts are three (E, out, in) tensors; transformers 5 holds them in
memory fused (`mlp.experts.gate_up_proj` (E, 2 moe_dim, dim): gate rows, then up rows;
`mlp.experts.down_proj`), but its save_pretrained writes, and the published checkpoints hold, one
tensor per expert (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`): we write that and
read either. Aux-free balancing's `expert_bias` has no HF counterpart (Qwen3MoeForCausalLM routes
by the router alone): a nonzero one is refused on export, and a load leaves it at zero.
"""

from __future__ import annotations

import dataclasses

import torch

from meshforge.core.errors import IncompatibleWeights

from ..common import hf_config as _hf_config
from ..common.adapter import StateDictAdapter
from ..common.hf_config import decoder_args, decoder_config, refuse
from ..common.hf_names import HFNames, name_from_torchtitan
from ..common.moe import is_moe_layer
from ..qwen3.adapter import HF_LAYER as QWEN3_LAYER
from ..qwen3.adapter import SLIDING_WINDOW_KEYS, refuse_sliding_windows
from .model import Qwen3MoeArgs

FAMILY = "qwen3_moe"
HF_LAYER = {**QWEN3_LAYER, "moe.router.gate.weight": "mlp.gate.weight"}
# one HF tensor per expert, as save_pretrained writes them
HF_EXPERTS = {
    "moe.experts.w1": "mlp.experts.{}.gate_proj.weight",
    "moe.experts.w3": "mlp.experts.{}.up_proj.weight",
    "moe.experts.w2": "mlp.experts.{}.down_proj.weight",
}
# transformers 5's in-memory layout, read too: (HF name, dim, chunk i, of n)
HF_FUSED = {
    "moe.experts.w1": ("mlp.experts.gate_up_proj", 1, 0, 2),
    "moe.experts.w3": ("mlp.experts.gate_up_proj", 1, 1, 2),
    "moe.experts.w2": ("mlp.experts.down_proj", 0, 0, 1),
}


def hf_permuted_heads(name: str, args: Qwen3MoeArgs) -> None:
    """Qwen3-MoE's HF rows are in our order: nothing is permuted."""
    return None


class MoENames(HFNames):
    """Qwen3's names, the router's and the experts'; refuses an `expert_bias` that routes."""

    def tensor_to_hf(self, name: str, t: torch.Tensor, args) -> tuple[str, torch.Tensor] | list | None:
        """As HFNames.tensor_to_hf; aux-free's selection bias: dropped when zero, else refused."""
        if name_from_torchtitan(name).endswith(".moe.expert_bias"):
            if bool(t.any()):
                raise IncompatibleWeights(
                    f"{name}: the model was trained with model.load_balance=aux_free, whose "
                    "selection bias has no place in HF's Qwen3MoeForCausalLM (its router picks "
                    "experts by probability alone): exported without it, tokens would reach other "
                    "experts than in training. Export a model trained with load_balance=aux_loss"
                )
            return None
        return super().tensor_to_hf(name, t, args)


MOE_KEYS = {
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",  # what HF returns (and adds to its loss), not the logits
}


def num_experts_of(cfg: dict) -> int:
    """num_experts (transformers 4, and the published files) or num_local_experts (what 5 writes)."""
    n, local = cfg.get("num_experts"), cfg.get("num_local_experts")
    if n is not None and local is not None and n != local:
        raise refuse("num_local_experts", local, f"differs from num_experts = {n}: which one is meant?")
    n = local if n is None else n
    if n is None:
        return 128  # Qwen3MoeConfig's default
    if not isinstance(n, int) or n < 1:
        raise refuse("num_experts", n, "a Qwen3-MoE without experts (all layers dense) is Qwen3: not read")
    return n


# how a model is trained, not what its weights compute
TRAINING_FIELDS = ("router_aux_loss_coef", "load_balance", "bias_update_rate", "grouped_mm")


def sparse_layers(args: Qwen3MoeArgs) -> list[int]:
    """The ids of the layers whose feed-forward is a mixture of experts."""
    return [i for i in range(args.n_layers) if is_moe_layer(args, i)]


# TorchTitan 0.2's Qwen3 MoE flavors (torchtitan/models/qwen3/__init__.py at v0.2.0): every block
# sparse, softmax top-k renormalised (route_norm), no shared experts, scores applied after the
# experts, untied; MoEArgs.load_balance_coeff = 1e-3 keeps an expert bias, but 0.2's qwen3 train
# spec registers no hook that moves it (build_optimizers; fixed after 0.2 by pytorch/torchtitan#3666)
# and there is no aux loss: the bias stays 0, which is aux_free with a rate of 0. Its dense
# Qwen3 flavors (debugmodel, 0.6B, ...) are not imported.
_TORCHTITAN_ARGS = dict(
    vocab_size=151936,
    head_dim=128,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_embeddings=False,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    load_balance="aux_free",
    bias_update_rate=0.0,
)
TORCHTITAN_FLAVORS = {
    "debugmodel_moe": dict(
        _TORCHTITAN_ARGS,
        vocab_size=2048,
        dim=256,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=3072,
        moe_dim=768,
        num_experts=64,
        num_experts_per_tok=8,
    ),
    "30B-A3B": dict(
        _TORCHTITAN_ARGS,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        moe_dim=768,
        num_experts=128,
        num_experts_per_tok=8,
    ),
    # rope_theta 5e6 as TorchTitan's flavor has it (meshforge's 235b-a22b, from config.json: 1e6)
    "235B-A22B": dict(
        _TORCHTITAN_ARGS,
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        ffn_dim=12288,
        moe_dim=1536,
        num_experts=128,
        num_experts_per_tok=8,
        rope_theta=5000000.0,
    ),
}
TORCHTITAN_BALANCING = (
    "qwen3 MoE: TorchTitan 0.2 routes by an expert bias (MoEArgs.load_balance_coeff = 1e-3) that its "
    "qwen3 train spec never moves (no balancing hook until pytorch/torchtitan#3666) and adds no aux "
    "loss: model.load_balance = aux_free with bias_update_rate = 0, unbalanced as there. "
    "bias_update_rate = 1e-3 is the later releases' balancing (TorchTitan also subtracts the update's "
    "mean from every bias: the same expert choices)"
)


class Qwen3MoeAdapter(StateDictAdapter):
    names = MoENames(HF_LAYER, hf_permuted_heads, "Qwen3-MoE", stacked=HF_EXPERTS, fused=HF_FUSED)
    hf_model_type = "qwen3_moe"
    torchtitan_model = "qwen3"
    torchtitan_flavors = TORCHTITAN_FLAVORS
    torchtitan_notes = (TORCHTITAN_BALANCING,)

    def hf_config(self, args: Qwen3MoeArgs, dtype: str = "float32") -> dict:
        """config.json of the equivalent HF Qwen3MoeForCausalLM (`num_experts`, which transformers 4
        and 5 both read; 5 itself writes `num_local_experts`)."""
        return decoder_config(
            args,
            "Qwen3MoeForCausalLM",
            self.hf_model_type,
            dtype,
            use_sliding_window=False,
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_dim,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=args.decoder_sparse_step,
            mlp_only_layers=list(args.mlp_only_layers),
            router_aux_loss_coef=args.router_aux_loss_coef,
            output_router_logits=False,
        )

    def args_from_hf_config(self, cfg: dict) -> Qwen3MoeArgs:
        """Qwen3MoeArgs of an HF Qwen3-MoE config.json (transformers 4 or 5 format); absent keys take
        Qwen3MoeConfig's defaults, and every key that would change the math and that we do not
        implement (shared experts, another router, sliding windows, ...) is refused by name."""
        cfg = {"intermediate_size": 6144, **cfg}  # Qwen3MoeConfig's default (unused when all sparse)
        fields = decoder_args(
            cfg, FAMILY, self.hf_model_type, MOE_KEYS | SLIDING_WINDOW_KEYS, default_max_positions=32768
        )
        refuse_sliding_windows(cfg)
        n = num_experts_of(cfg)
        k = cfg.get("num_experts_per_tok", 8)
        if not isinstance(k, int) or not 1 <= k <= n:
            raise refuse("num_experts_per_tok", k, f"top-k must be between 1 and num_experts = {n}")
        step = cfg.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise refuse("decoder_sparse_step", step, "every step-th layer is sparse: it must be >= 1")
        return Qwen3MoeArgs(
            **fields,
            head_dim=cfg.get("head_dim") or fields["dim"] // fields["n_heads"],
            num_experts=n,
            num_experts_per_tok=k,
            moe_dim=cfg.get("moe_intermediate_size", 768),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # Qwen3MoeConfig's default: False
            decoder_sparse_step=step,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        )

    def check_compatible(self, checkpoint_args: Qwen3MoeArgs, recipe_args: Qwen3MoeArgs) -> list[str]:
        """What differs between a checkpoint's model and the recipe's (empty when they match): the
        shapes and numbers of hf_config.check_compatible, the router's, and which layers are sparse
        (however decoder_sparse_step and mlp_only_layers spell it); training settings may differ."""
        keep = (*TRAINING_FIELDS, "decoder_sparse_step", "mlp_only_layers")
        same = dataclasses.replace(checkpoint_args, **{k: getattr(recipe_args, k) for k in keep})
        diff = _hf_config.check_compatible(same, recipe_args)
        ours, theirs = sparse_layers(checkpoint_args), sparse_layers(recipe_args)
        if ours != theirs:
            diff.append(f"sparse layers: checkpoint {ours}, recipe {theirs}")
        return diff


ADAPTER = Qwen3MoeAdapter()
