"""The DeviceMesh built from the parallel degrees, and the sub-meshes each part needs.

The topology itself (dim order, coordinates, labels) is `meshforge.core.topology.ParallelDims`.
"dp" is the flattened dp_replicate x dp_shard sub-mesh used for data sharding and for
loss/gradient-norm reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.core.topology import DP_DIMS, MESH_DIMS, ParallelDims


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the sub-meshes each component needs (kept, not re-sliced)."""

    root: DeviceMesh
    dp: DeviceMesh  # flattened dp_replicate x dp_shard: data sharding, token counts
    fsdp: DeviceMesh  # 2-D for HSDP, else dp_shard
    tp: DeviceMesh
    pp: DeviceMesh


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """The world's DeviceMesh over MESH_DIMS (outer to inner) and its sub-meshes."""
    root = init_device_mesh(device_type, tuple(dims.degrees.values()), mesh_dim_names=MESH_DIMS)
    return Meshes(
        root=root,
        dp=root[DP_DIMS]._flatten("dp"),
        fsdp=root[DP_DIMS] if dims.dp_replicate > 1 else root["dp_shard"],
        tp=root["tp"],
        pp=root["pp"],
    )
