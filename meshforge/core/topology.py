"""The parallel degrees as a validated value object: the one owner of the topology.

Mesh dims, outer to inner: pp, dp_replicate, dp_shard, cp, tp (TorchTitan's order). Tensor
parallel is innermost so its ranks are neighbours (same node, fastest links); context parallel
next (an all-gather of K/V or four all-to-alls per layer, more traffic than data parallel's
once-a-step reductions, less than TP's); pipeline is outermost (least traffic). FSDP shards over
dp_shard x cp together: the cp ranks hold other tokens of the same samples, so their gradients
are summed like data-parallel ones. Expert parallel (ep) is not a factor of the world: it borrows
its ranks from dp_shard x cp (TorchTitan's rule), the inner ep of them holding different experts
and exchanging tokens, the experts then FSDP-sharded over the rest (dp_shard x cp / ep).
Everything that needs a rank's place in the mesh (validation, the estimator, sweeps, golden
dumps, the DeviceMesh itself) asks this class. Pure Python: no devices, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from meshforge.core.errors import Problem, RecipeError

MESH_DIMS = (
    "pp",
    "dp_replicate",
    "dp_shard",
    "cp",
    "tp",
)  # outer -> inner: the one spelling of the dim order
BORROWED = ("ep",)  # degrees whose ranks are other dims' (ep: of dp_shard x cp), not world factors
LAYOUT_DIMS = (*MESH_DIMS, *BORROWED)  # what a layout is made of: its records, sweeps and overrides
ADDED_LATER = ("cp", "ep")  # dims that records written before them lack
DP_DIMS = ("dp_replicate", "dp_shard")  # the data-parallel dims, outer -> inner (a batch splits over both)
FSDP_SHARD_DIMS = ("dp_shard", "cp")  # what FSDP shards over (flattened): cp ranks sum gradients too
FSDP_SHARD = "dp_shard_cp"  # their flattened DeviceMesh dim (under cp; without it FSDP's mesh is dp_shard)
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")  # the experts' mesh: dp_shard x cp split
FLATTENED = {FSDP_SHARD: FSDP_SHARD_DIMS}  # a flattened DeviceMesh dim -> the mesh dims it spans
_LABELS = (
    ("dp_replicate", "dprep"),
    ("dp_shard", "dp"),
    ("cp", "cp"),
    ("ep", "ep"),
    ("tp", "tp"),
    ("pp", "pp"),
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # borrowed from dp_shard x cp (BORROWED): not a factor of world_size

    def __post_init__(self):
        bad = {n: d for n, d in self.degrees.items() if not isinstance(d, int) or d < 1}
        if bad:
            raise ValueError(f"mesh degrees must be resolved positive integers, got {self.spelled()}")

    @classmethod
    def from_config(cls, mesh_cfg) -> ParallelDims:
        return cls(**{name: getattr(mesh_cfg, name) for name in LAYOUT_DIMS})

    @classmethod
    def from_degrees(cls, degrees: Mapping[str, int]) -> ParallelDims:
        """From a mapping holding every mesh dim (run.json's "mesh", a sweep row); other keys are
        ignored, and a dim the record predates (cp, ep) is 1, as it was when the record was written."""
        return cls(
            **{
                name: degrees[name] if name not in ADDED_LATER else degrees.get(name, 1)
                for name in LAYOUT_DIMS
            }
        )

    @classmethod
    def all_of_world(cls, world: int, experts: int = 0) -> list[ParallelDims]:
        """Every shape whose product is `world`, in field order (the last mesh dim takes the rest);
        for a model with `experts` per sparse layer, each shape once per ep it can take (dividing
        both its dp_shard x cp, whose ranks ep borrows, and the experts, which ep splits whole)."""
        *free, last = (f.name for f in fields(cls) if f.name in MESH_DIMS)
        shapes: list[dict[str, int]] = [{}]
        for name in free:
            shapes = [{**s, name: d} for s in shapes for d in divisors(world // math.prod(s.values()))]
        dims = [cls(**s, **{last: world // math.prod(s.values())}) for s in shapes]
        if not experts:
            return dims
        return [replace(d, ep=e) for d in dims for e in divisors(math.gcd(d.fsdp_shard, experts))]

    @property
    def degrees(self) -> dict[str, int]:
        """Degree per layout dim: the mesh dims outer to inner (the DeviceMesh's order), then ep."""
        return {name: getattr(self, name) for name in LAYOUT_DIMS}

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Degree per DeviceMesh dim, outer to inner: the world's factors (no borrowed dims)."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    def spelled(self) -> str:
        """The degrees as a person reads them: every mesh dim, a borrowed one (ep) only when in use."""
        return ", ".join(f"{n}={d}" for n, d in self.degrees.items() if n in MESH_DIMS or d > 1)

    def overrides(self) -> list[str]:
        """The recipe overrides that select this mesh."""
        return [f"mesh.{n}={d}" for n, d in self.degrees.items()]

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape.values())

    def check_world(self, world_size: int) -> None:
        """Refuse a world of another size than this mesh's (a launch that does not match the recipe)."""
        if world_size != self.world_size:
            fix = f"needs {self.world_size} ranks, {world_size} are running; launch that many or change it"
            raise RecipeError([Problem("mesh", self.spelled(), fix)])

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """How many ranks FSDP shards a parameter over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        # FSDP2 also serves pure replication (dp_shard=1): HSDP with a shard dim of 1; under cp
        # it sums the gradients of the cp ranks' tokens
        return self.dp * self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def label(self) -> str:
        """Short name of the shape, e.g. dp2-tp2-pp2 (run names, sweeps, W&B)."""
        return (
            "-".join(f"{short}{getattr(self, n)}" for n, short in _LABELS if getattr(self, n) > 1) or "single"
        )

    def coordinate(self, rank: int) -> dict[str, int]:
        """Global rank -> its coordinate on every mesh dim (row-major over MESH_DIMS)."""
        coord, rest = {}, rank
        for name in reversed(MESH_DIMS):
            rest, coord[name] = divmod(rest, getattr(self, name))
        return {n: coord[n] for n in MESH_DIMS}

    def role_ranks(self) -> list[int]:
        """One global rank per pipeline stage (coordinate 0 on every other dim): the ranks
        whose memory differs; data- and tensor-parallel peers hold the same shapes."""
        inner = self.world_size // self.pp
        return [p * inner for p in range(self.pp)]
