"""The parallel degrees as a validated value object, and the DeviceMesh built from them.

Mesh dims, outer to inner: pp, dp_replicate, dp_shard, tp. Tensor parallel is innermost
so its ranks are neighbours (same node, fastest links); pipeline is outermost (least
traffic). "dp" is the flattened dp_replicate x dp_shard sub-mesh used for data sharding
and for loss/gradient-norm reductions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        bad = {n: d for n, d in self.degrees.items() if not isinstance(d, int) or d < 1}
        if bad:
            spelled = ", ".join(f"{n}={d}" for n, d in self.degrees.items())
            raise ValueError(f"mesh degrees must be resolved positive integers, got {spelled}")

    @classmethod
    def from_config(cls, mesh_cfg) -> "ParallelDims":
        return cls(mesh_cfg.dp_replicate, mesh_cfg.dp_shard, mesh_cfg.tp, mesh_cfg.pp)

    @property
    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        # FSDP2 also serves pure replication (dp_shard=1): HSDP with a shard dim of 1
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def label(self) -> str:
        """Short name of the shape, e.g. dp2-tp2-pp2 (used for run names and sweeps)."""
        parts = [f"{n}{d}" for n, d in (("dprep", self.dp_replicate), ("dp", self.dp_shard), ("tp", self.tp), ("pp", self.pp)) if d > 1]
        return "-".join(parts) or "single"

    def build_mesh(self, device_type: str) -> "Meshes":
        root = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS)
        return Meshes(
            root=root,
            dp=root["dp_replicate", "dp_shard"]._flatten("dp"),
            fsdp=root["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else root["dp_shard"],
            tp=root["tp"],
            pp=root["pp"],
        )


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the sub-meshes each component needs (kept, not re-sliced)."""

    root: DeviceMesh
    dp: DeviceMesh  # flattened dp_replicate x dp_shard: data sharding, token counts
    fsdp: DeviceMesh  # 2-D for HSDP, else dp_shard
    tp: DeviceMesh
    pp: DeviceMesh
