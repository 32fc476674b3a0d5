"""The one place that composes the parallelisms, in a fixed order:

0. float8    - swap the chosen Linears for torchao's Float8Linear (parallelisms/float8.py) on the
               whole meta model: TP and FSDP then shard them as any Linear.
1. PP split  - cut the meta model into this rank's stages first: every later step then
               works on a stage exactly as on a whole model, and sees only its layers.
   EP        - each stage's experts become DTensors sharded over ep and its MoEs dispatch tokens
               to the rank holding their expert (parallelisms/ep.py); before FSDP, which shards
               the experts again over the rest of dp_shard x cp.
   CP        - each stage's attention attends across the cp ranks and its RoPE takes their
               positions (`Attention.attend`, `rope_positions`: attributes, not modules, so it
               commutes with TP and FSDP); before compile, so the collectives are compiled in.
2. TP        - turns Linear/Embedding weights into DTensors on the tp mesh; must come
               before FSDP, which shards those DTensors again over dp (2-D weights).
3. AC        - wraps block forwards (whole blocks, or per op: `activation_checkpoint.mode=op`);
               inside FSDP's hooks so the recompute in backward runs while the block's
               parameters are still gathered.
4. compile   - per block, after AC so the checkpointed region is compiled as one, and
               before FSDP so FSDP's hooks stay outside the compiled graph.
5. FSDP      - last: it groups whatever the earlier steps left, per block plus root.

Weights stay on the meta device throughout; `materialize` fills them afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from meshforge.configs import ac_policy
from meshforge.configs.schema import (
    ActivationCheckpointConfig,
    CompileConfig,
    CPConfig,
    Float8Config,
    FSDPConfig,
    PPConfig,
    TPConfig,
)
from meshforge.core.topology import ParallelDims
from meshforge.models import ModelSpec

from .ac import apply_ac
from .compile import apply_compile
from .cp import apply_cp
from .ep import apply_ep
from .float8 import apply_float8
from .fsdp import apply_fsdp, fsdp_applies
from .mesh import Meshes
from .pp import pipeline_split
from .tp import apply_tp


@dataclass
class ParallelModel:
    """This rank's model parts (one per local pipeline stage) and where they sit."""

    parts: list[nn.Module]
    stage_ids: list[int] = field(default_factory=lambda: [0])
    layout: list[list[int]] = field(default_factory=list)  # layer ids of every stage


def parallelize(
    model: nn.Module,
    meshes: Meshes | None,
    dims: ParallelDims,
    spec: ModelSpec,
    *,
    tp: TPConfig,
    pp: PPConfig,
    cp: CPConfig,
    seq_len: int,
    device_type: str = "cpu",
    ac: ActivationCheckpointConfig,
    compile: CompileConfig,
    fsdp: FSDPConfig,
    float8: Float8Config,
) -> ParallelModel:
    """Apply float8 -> PP (+ EP, CP) -> TP -> AC -> compile -> FSDP to a meta-device `model` (see module doc);
    `seq_len`: the tokens of one whole sequence, which cp splits; `device_type`: where the model
    will run (a kernel choice of cp's, and float8's: emulated on a CPU)."""
    if float8.enabled:
        apply_float8(model, float8, device_type)
    if dims.pp_enabled:
        parts, ids, layout = pipeline_split(model, meshes.pp, pp)
    else:
        parts, ids, layout = [model], [0], [list(range(len(model.layers)))]
    for part in parts:
        if dims.ep_enabled:
            apply_ep(part, meshes.ep)
        if dims.cp_enabled:
            apply_cp(part, meshes.cp, cp, seq_len, dims.tp, device_type)
        if dims.tp_enabled:
            apply_tp(part, meshes.tp, tp, spec)
        apply_ac(part, ac_policy(ac))
        apply_compile(part, compile)
        if fsdp_applies(dims, fsdp):
            apply_fsdp(part, meshes.fsdp, fsdp, meshes.experts_fsdp)
    return ParallelModel(parts, ids, layout)
