"""The analytic memory estimate: closed-form model states and activations per rank, no trace.

It serves the pre-launch machine check, the dry-run plan and the OOM report; the traced
estimate (`simulate/estimate.py`, a rank run under fake tensors) is the accurate one, and
sits above `run` because it drives the run's own step."""

from __future__ import annotations

from meshforge.configs import Recipe, ac_policy
from meshforge.configs.schema import OptimizerConfig
from meshforge.core.topology import ParallelDims
from meshforge.models.common.moe import has_experts
from meshforge.parallelisms.fsdp import DTYPES


def optimizer_states(cfg: OptimizerConfig, args, n_params: int) -> float:
    """fp32 optimizer states per parameter: AdamW 2 (its moments), SGD 1 (momentum; 0 without),
    Lion 1, Muon 1 on hidden matrices and AdamW's 2 on embeddings and output (norms, router and
    biases, a rounding error, counted as matrices)."""
    if cfg.name == "muon":
        tables = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
        return 1 + tables / n_params
    return {"adamw": 2.0, "sgd": 1.0 if cfg.sgd.momentum > 0 else 0.0, "lion": 1.0}[cfg.name]


def state_bytes(n_params: int, dims: ParallelDims, experts: int = 0, states: float = 2.0) -> float:
    """fp32 parameters, gradients and `states` optimizer states (AdamW: 2, 16 bytes a parameter), sharded over
    dp_shard x cp x tp x pp (FSDP shards over dp_shard x cp); replicas (dp_replicate) hold full copies.
    `experts` of them (a MoE's expert weights) are not split over tp: every tp rank holds its
    dp_shard x cp (ep x FSDP) share of them whole."""
    dense = n_params - experts
    return (8 + 4 * states) * (
        dense / (dims.fsdp_shard * dims.tp * dims.pp) + experts / (dims.fsdp_shard * dims.pp)
    )


def placed_state_bytes(
    n_params: int, dims: ParallelDims, cpu_offload: bool, experts: int = 0, states: float = 2.0
) -> tuple[float, float]:
    """(on the device, on the host) of `state_bytes`: FSDP's CPU offload keeps the sharded
    parameters, gradients and optimizer state on the host, so the device holds none of them
    (only the gathered compute copies, counted with activations as without offload)."""
    held = state_bytes(n_params, dims, experts, states)
    return (0.0, held) if cpu_offload else (held, 0.0)


def activation_bytes(r: Recipe, args, dims: ParallelDims) -> float:
    """A rough per-rank activation peak for one micro-batch (Korthikanti et al. 2022:
    ~34 bytes x tokens x dim per layer in 16-bit, /tp), plus the fp32 logits, their
    softmax and gradient (3 x 4 bytes x tokens x vocab / tp) on the last stage; a cp rank
    holds seq_len / cp tokens of every sequence."""
    tokens = r.train.micro_batch_size * r.train.seq_len // dims.cp
    bytes_per_value = DTYPES[r.fsdp.param_dtype].itemsize
    per_layer = 17 * bytes_per_value * tokens * args.dim / dims.tp
    if has_experts(args):  # a sparse layer's MoE, on every tp rank whole: the token copies sent to
        # experts and back (2 dim each), their three hidden projections, the fp32 router probabilities
        copies = tokens * args.num_experts_per_tok
        moe = bytes_per_value * copies * (2 * args.dim + 3 * args.moe_dim) + 4 * tokens * args.num_experts
        per_layer += moe * args.n_moe_layers / args.n_layers
    layers = args.n_layers / dims.pp
    ac = ac_policy(r.activation_checkpoint)
    if ac.wraps_blocks and not ac.per_op:  # whole blocks: every `period`-th keeps only its input
        kept = layers * (1 - 1 / ac.period)  # + one block's recompute
        stored = kept * per_layer + (layers - kept) * tokens * args.dim * bytes_per_value + per_layer
    else:  # none, per-op AC and a memory budget counted as none: an upper bound (the traced estimate
        stored = layers * per_layer  # sees what per-op AC keeps)
    return stored + 12 * tokens * args.vocab_size / dims.tp
