"""How the model is spread over the devices and compiled: [mesh] and each parallelism's policy
([fsdp], [tp], [cp], [pp]), [compile], [float8] (linear layers in float8 by torchao,
parallelisms/float8.py). Activation checkpointing's is configs/activation_checkpoint.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from meshforge.core.topology import MESH_DIMS

from .fields import NO_FSDP, NO_PP, F, unread_with


@dataclass
class MeshConfig:
    dp_replicate: int = F(1, "data-parallel replicas (DDP, or the outer dim of HSDP); -1 = the rest")
    dp_shard: int = F(-1, "FSDP shard degree; -1 = the rest of the world size")
    cp: int = F(
        1,
        "context-parallel degree (every sequence split over cp ranks, attention across them; FSDP "
        "shards over dp_shard x cp)",
    )
    tp: int = F(1, "tensor-parallel degree (heads and FFN split across ranks)")
    pp: int = F(1, "pipeline-parallel degree (layers split into stages)")
    ep: int = F(
        1,
        "expert-parallel degree (MoE): experts split over ep ranks borrowed from dp_shard x cp, which "
        "it must divide; not a factor of the world size",
    )


def mesh_world_size(mesh: MeshConfig) -> int | None:
    """The world size the mesh spells out, or None if a degree is -1 (sized by the world later)."""
    degrees = [getattr(mesh, n) for n in MESH_DIMS]
    return None if -1 in degrees else math.prod(degrees)


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = F(
        True,
        "free gathered params after forward (saves memory, costs a 2nd all-gather)" + NO_FSDP,
    )
    param_dtype: str = F(
        "float32",
        "dtype of compute params: float32 | bfloat16 | float16 (with a loss scale, [loss_scale]); "
        "autocast when FSDP is off; float32 stays true fp32 (TF32 off), its MFU is against the fp32 peak",
    )
    reduce_dtype: str = F("float32", "dtype of gradient reductions: float32 | bfloat16 | float16" + NO_FSDP)
    cpu_offload: bool = F(False, "keep sharded params, grads and optimizer state on the CPU")


@dataclass
class TPConfig:
    sequence_parallel: bool = F(
        True, "shard norms and residuals along the sequence between TP regions" + unread_with("mesh.tp = 1")
    )
    loss_parallel: bool = F(
        True, "keep logits vocab-sharded and compute cross-entropy in parallel" + unread_with("mesh.tp = 1")
    )


@dataclass
class CPConfig:
    method: str = F(
        "allgather",
        "allgather (K and V gathered over cp, TorchTitan's) | alltoall (Ulysses: heads exchanged, "
        "needs n_heads and kv_heads / tp divisible by cp)" + unread_with("mesh.cp = 1"),
    )


@dataclass
class PPConfig:
    schedule: str = F(
        "1F1B",
        "GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV"
        + NO_PP,
    )
    microbatches: int = F(-1, "microbatches per step per pipeline; -1 = number of stages" + NO_PP)
    stages_per_rank: int = F(1, "virtual stages per rank (2+ for interleaved/looped/V schedules)" + NO_PP)
    layers_per_stage: Optional[List[int]] = F(
        None, "explicit layer count per stage, e.g. [3, 5]; None = balanced" + NO_PP
    )
    embedding_weight: float = F(
        0.0, "tok_embeddings counted as this many layers when balancing stages" + NO_PP
    )
    output_weight: float = F(0.0, "norm + output counted as this many layers when balancing stages" + NO_PP)


@dataclass
class CompileConfig:
    enabled: bool = F(False, "torch.compile each transformer block")
    backend: str = F("inductor", "torch.compile backend" + unread_with("compile.enabled = false", "a switch"))


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class Float8Config:
    enabled: bool = F(
        False,
        "train the blocks' linear layers in float8 (torchao's Float8Linear: float8 matmuls, "
        "high-precision weights and optimizer); the output head, MoE routers and experts stay",
    )
    recipe: str = F(
        "rowwise",
        "torchao's scaling: tensorwise (one scale a tensor; a rank scales its activations by their own "
        "amax, so dp layouts round slightly differently) | rowwise (one a row: layout-independent, more "
        "accurate) | rowwise_with_gw_hp (rowwise, the weight gradient's matmul in high precision)",
    )
    exclude: List[str] = F(
        ["output"],
        "module names kept in high precision (a name matches itself and what ends in .name); layers with "
        "a dim not divisible by 16 and MoE routers are always kept",
    )
