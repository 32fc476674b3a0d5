"""The DeviceMesh built from the parallel degrees, and the sub-meshes each part needs.

The topology itself (dim order, coordinates, labels) is `meshforge.core.topology.ParallelDims`.
"dp" is the flattened dp_replicate x dp_shard sub-mesh used for data sharding and token counts
(the cp ranks of a dp rank read the same samples); FSDP shards over dp_shard x cp flattened
("dp_shard_cp"), replicating over dp_replicate (HSDP) when it is > 1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.core.topology import (
    DP_DIMS,
    EP_MESH_DIMS,
    FSDP_SHARD,
    FSDP_SHARD_DIMS,
    MESH_DIMS,
    ParallelDims,
)


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the sub-meshes each component needs (kept, not re-sliced)."""

    root: DeviceMesh
    dp: DeviceMesh  # flattened dp_replicate x dp_shard: data sharding, token counts
    fsdp: DeviceMesh  # 2-D for HSDP (dp_replicate, dp_shard_cp), else dp_shard_cp
    cp: DeviceMesh
    tp: DeviceMesh
    pp: DeviceMesh
    ep: DeviceMesh | None = None  # expert parallel: ranks of dp_shard x cp that hold different experts
    experts_fsdp: DeviceMesh | None = None  # what FSDP shards experts over under ep: the rest of them


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """The world's DeviceMesh over MESH_DIMS (outer to inner) and its sub-meshes."""
    root = init_device_mesh(device_type, tuple(dims.mesh_shape.values()), mesh_dim_names=MESH_DIMS)
    ep = experts_fsdp = None
    if dims.ep_enabled:
        ep, experts_fsdp = _expert_meshes(device_type, dims)
    return Meshes(
        root=root,
        dp=root[DP_DIMS]._flatten("dp"),
        fsdp=_fsdp_mesh(root, dims),
        cp=root["cp"],
        tp=root["tp"],
        pp=root["pp"],
        ep=ep,
        experts_fsdp=experts_fsdp,
    )


def _expert_meshes(device_type: str, dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh]:
    """The ep mesh and the experts' FSDP mesh, sliced from one mesh of the same ranks with
    dp_shard x cp split into (dp_shard_mod_ep, ep), row-major as the world's mesh is: an ep group is
    ep consecutive (dp_shard, cp) coordinates. FSDP needs both from one root (its 2-D sharding of an
    ep DTensor), which the world's mesh cannot be: ep is no dim of it."""
    shape = dict(dims.mesh_shape, dp_shard_mod_ep=dims.fsdp_shard // dims.ep, ep=dims.ep)
    root = init_device_mesh(device_type, tuple(shape[n] for n in EP_MESH_DIMS), mesh_dim_names=EP_MESH_DIMS)
    fsdp = root[("dp_replicate", "dp_shard_mod_ep")] if dims.dp_replicate > 1 else root["dp_shard_mod_ep"]
    return root["ep"], fsdp


def _fsdp_mesh(root: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """dp_shard (x cp, flattened), with dp_replicate before it for HSDP. Without cp the mesh keeps
    the name dp_shard (placements and golden dumps name it)."""
    if not dims.cp_enabled:
        return root[DP_DIMS] if dims.dp_replicate > 1 else root["dp_shard"]
    shard = root[FSDP_SHARD_DIMS]._flatten(FSDP_SHARD)
    if dims.dp_replicate == 1:
        return shard
    with warnings.catch_warnings():  # torch 2.13 slices a flattened dim (its note: deprecated one day)
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return root[("dp_replicate", FSDP_SHARD)]
