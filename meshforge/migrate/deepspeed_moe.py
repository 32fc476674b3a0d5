"""DeepSpeed's AutoEP section, `expert_parallel` (DeepSpeed 0.19: module_inject/auto_ep_config.py,
auto_ep_folding.py) -> mesh.ep and the router's [model] fields.

AutoEP swaps a HF model's MoE blocks for TorchTitan-style grouped experts spread over `autoep_size`
consecutive ranks of a pipeline stage (meshforge's ep: the inner ranks of dp_shard x cp). The model
itself is not in the JSON: it comes from --model or --base and must have experts (qwen3_moe). Its
other MoE layers (deepspeed.moe.layer.MoE) are model code, with no JSON key.
"""

from __future__ import annotations

import math

from meshforge.core.errors import UsageError
from meshforge.migrate.report import Imported
from meshforge.migrate.source import MISSING, Keys
from meshforge.models import MODELS
from meshforge.models.common.moe import has_experts

S = "expert_parallel"
DETECTION = "how AutoEP finds the MoE blocks in the HF model's code: meshforge's qwen3_moe is built with them"
COMM = "the all-to-all's backend and buffers: the same tokens reach the same experts"
NOT_MAPPED = {
    "validate_folding_routing": "a DeepSpeed self-check",
    "async_split_plan": "when the all-to-all sizes reach the host: same math",
    "disable_triton_grouped_mm": "which grouped-matmul kernel",
    "combine_impl": "how the experts' outputs are summed: same math",
    "row_weighting_impl": "how the routing weights are applied: same math",
    "gate_up_impl": "whether w1 and w3 run as one matmul: same math",
    "comm_backend": COMM,
    "comm_num_sm": COMM,
    "comm_qp_margin": COMM,
    "comm_max_tokens_per_rank": COMM,
    "moe_layer_pattern": DETECTION,
    "router_pattern": DETECTION,
    "expert_pattern": DETECTION,
    "expert_w1": DETECTION,
    "expert_w2": DETECTION,
    "expert_w3": DETECTION,
    "num_experts_attr": DETECTION,
    "top_k_attr": DETECTION,
    "shared_experts_pattern": DETECTION,
    "shared_experts_gate_pattern": DETECTION,
}
# key -> (the values meshforge's router matches, why another value is refused)
ROUTER = {
    "score_func": (("auto", "softmax"), "meshforge's router is a softmax"),
    "score_apply": (("auto", "post"), "routing weights applied before SwiGLU experts: other math"),
    "route_scale": ((1, 1.0), "scaled routing weights: meshforge's are the router's probabilities"),
    "routed_scaling_factor": (("auto", 1, 1.0), "scaled routing weights: meshforge's are the probabilities"),
    "num_expert_groups": ((None,), "group-limited routing (DeepSeek's)"),
    "num_limited_groups": ((None,), "group-limited routing (DeepSeek's)"),
    "has_shared_experts": ((None, False), "shared experts: meshforge's qwen3_moe has none"),
    "expert_activation": ((None, "swiglu"), "meshforge's experts are SwiGLU"),
}


def auto_ep(k: Keys, out: Imported, experts: int | None, world: int, pp: int, sp: int) -> None:
    """`experts`: the model's experts per layer (None: a dense model); `pp`, `sp`: the pipeline
    stages and Ulysses degree already mapped. Runs after the ZeRO stage set the data-parallel dims."""
    if (v := k.take("use_data_before_expert_parallelism", False)) is not False:
        out.skip(
            "use_data_before_expert_parallelism",
            v,
            "which ranks form an expert group (strided ones): meshforge's are consecutive; same math",
        )
    section = k.data.get(S)
    if not isinstance(section, dict):
        return
    if (coeff := k.take(f"{S}.load_balance_coeff", None)) is not None:  # DeepSpeed's parse refuses it
        raise UsageError(
            f"DeepSpeed: load_balance_coeff={coeff!r} is not supported in this AutoEP build: set it to null "
            "or omit the key"
        )
    enabled = k.take(f"{S}.enabled", False)
    if not enabled or not experts:
        if enabled:
            out.refuse(f"{S}.enabled", enabled, "the model has no experts: --model qwen3_moe:FLAVOR")
        why = "AutoEP is off (enabled = false)" if not enabled else "AutoEP of a dense model (refused above)"
        for key in list(section):
            out.skip(f"{S}.{key}", k.take(f"{S}.{key}"), why)
        return
    ep, etp = k.take(f"{S}.autoep_size", 1), k.take(f"{S}.expert_tensor_parallel_size", 1)
    stage = world // pp
    if not isinstance(ep, int) or ep < 1 or stage % (ep * etp):
        raise UsageError(
            f"DeepSpeed: expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size ({ep} * "
            f"{etp} = {ep * etp}) must divide the stage size (world_size={world} / pp_size={pp} = {stage})"
        )
    if etp != 1:
        raise UsageError(
            f"DeepSpeed: expert_parallel.expert_tensor_parallel_size={etp} is reserved for expert-internal "
            "tensor parallelism and is not supported yet. Use expert_tensor_parallel_size=1"
        )
    out.set("mesh.ep", ep)
    if ep > 1 and out.values["mesh.dp_shard"] * sp % ep:  # ZeRO 0: ep needs FSDP's ranks here
        shard = ep // math.gcd(ep, sp)
        out.set("mesh.dp_shard", shard)
        out.set("mesh.dp_replicate", out.values["mesh.dp_replicate"] // shard)
        out.set("fsdp.reshard_after_forward", False)
        out.notes.append(
            f"autoep_size = {ep} under ZeRO 0: meshforge's ep borrows FSDP's ranks (dp_shard x cp), so "
            f"mesh.dp_shard = {shard} (ZeRO-2-like: parameters sharded over them, less memory, the same "
            "math), dp_replicate the rest"
        )
    _router(k, out)
    for key, why in NOT_MAPPED.items():
        if (v := k.take(f"{S}.{key}")) is not MISSING:
            out.skip(f"{S}.{key}", v, why)
    out.notes.append(
        "AutoEP moves no expert bias (load_balance_coeff must be null): the balancing is the HF model's aux "
        "loss, which it adds only with output_router_logits = true in its config.json; here "
        "model.router_aux_loss_coef from --model/--base (qwen3_moe: 0.001; 0 for a model trained without)"
    )


def _router(k: Keys, out: Imported) -> None:
    """top_k, route_norm and use_grouped_mm map to [model]; the rest must match meshforge's router."""
    for key, field in (
        ("top_k", "num_experts_per_tok"),
        ("route_norm", "norm_topk_prob"),
        ("use_grouped_mm", "grouped_mm"),
    ):
        if (v := k.take(f"{S}.{key}")) not in (MISSING, None, "auto"):
            out.set(f"model.{field}", v)
    preset, presets = k.take(f"{S}.preset_model"), moe_model_types()
    if preset in presets:  # the HF model_type of one of meshforge's MoE families
        out.skip(f"{S}.preset_model", preset, DETECTION)
    elif preset not in (MISSING, None):
        out.refuse(f"{S}.preset_model", preset, f"another MoE family: meshforge's are {', '.join(presets)}")
    for key, (fine, why) in ROUTER.items():
        v = k.take(f"{S}.{key}")
        if v is not MISSING and v is not None and v not in fine:
            out.refuse(f"{S}.{key}", v, why)


def moe_model_types() -> list[str]:
    """AutoEP's preset_model names a HF model_type: those of the registered families with experts."""
    return [s.adapter.hf_model_type for s in MODELS.values() if any(map(has_experts, s.flavors.values()))]
