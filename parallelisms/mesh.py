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

from meshforge.core.topology import DP_DIMS, FSDP_SHARD, FSDP_SHARD_DIMS, MESH_DIMS, ParallelDims


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the sub-meshes each component needs (kept, not re-sliced)."""

    root: DeviceMesh
    dp: DeviceMesh  # flattened dp_replicate x dp_shard: data sharding, token counts
    fsdp: DeviceMesh  # 2-D for HSDP (dp_replicate, dp_shard_cp), else dp_shard_cp
    cp: DeviceMesh
    tp: DeviceMesh
    pp: DeviceMesh


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """The world's DeviceMesh over MESH_DIMS (outer to inner) and its sub-meshes."""
    root = init_device_mesh(device_type, tuple(dims.degrees.values()), mesh_dim_names=MESH_DIMS)
    return Meshes(
        root=root,
        dp=root[DP_DIMS]._flatten("dp"),
        fsdp=_fsdp_mesh(root, dims),
        cp=root["cp"],
        tp=root["tp"],
        pp=root["pp"],
    )


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
