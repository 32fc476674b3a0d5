"""The analytic memory estimate: closed-form model states and activations per rank, no trace.

It serves the pre-launch machine check, the dry-run plan and the OOM report; the traced
estimate (`simulate/estimate.py`, a rank run under fake tensors) is the accurate one, and
sits above `run` because it drives the run's own step."""

from __future__ import annotations

from meshforge.configs import Recipe
from meshforge.core.topology import ParallelDims
from meshforge.parallelisms.fsdp import DTYPES


def state_bytes(n_params: int, dims: ParallelDims) -> float:
    """fp32 parameters, gradients and AdamW's two moments (16 bytes a parameter), sharded over
    dp_shard x cp x tp x pp (FSDP shards over dp_shard x cp); replicas (dp_replicate) hold full copies."""
    return 16 * n_params / (dims.fsdp_shard * dims.tp * dims.pp)


def placed_state_bytes(n_params: int, dims: ParallelDims, cpu_offload: bool) -> tuple[float, float]:
    """(on the device, on the host) of `state_bytes`: FSDP's CPU offload keeps the sharded
    parameters, gradients and optimizer state on the host, so the device holds none of them
    (only the gathered compute copies, counted with activations as without offload)."""
    states = state_bytes(n_params, dims)
    return (0.0, states) if cpu_offload else (states, 0.0)


def activation_bytes(r: Recipe, args, dims: ParallelDims) -> float:
    """A rough per-rank activation peak for one micro-batch (Korthikanti et al. 2022:
    ~34 bytes x tokens x dim per layer in 16-bit, /tp), plus the fp32 logits, their
    softmax and gradient (3 x 4 bytes x tokens x vocab / tp) on the last stage; a cp rank
    holds seq_len / cp tokens of every sequence."""
    tokens = r.train.micro_batch_size * r.train.seq_len // dims.cp
    bytes_per_value = DTYPES[r.fsdp.param_dtype].itemsize
    per_layer = 17 * bytes_per_value * tokens * args.dim / dims.tp
    layers = args.n_layers / dims.pp
    if r.activation_checkpoint.mode == "full":
        stored = layers * tokens * args.dim * bytes_per_value + per_layer  # block inputs + one recompute
    elif r.activation_checkpoint.mode == "selective":
        kept = layers * (1 - 1 / r.activation_checkpoint.selective_every)
        stored = kept * per_layer + (layers - kept) * tokens * args.dim * bytes_per_value + per_layer
    else:  # none, and per-op AC counted as none: an upper bound (the traced estimate sees what it keeps)
        stored = layers * per_layer
    return stored + 12 * tokens * args.vocab_size / dims.tp
