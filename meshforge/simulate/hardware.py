"""A hardware profile: how fast one rank computes and how fast its groups communicate.

The step-time model (`meshforge tune`) prices a traced step with it: matmuls at `matmul_rate`,
memory-bound ops at `memory_Bps`, every collective at `collective_time`. Rates are *achievable*
ones (measured by `simulate/calibrate.py`, or a vendor's peak scaled to what is reached in
practice, cited in the file), never raw datasheet peaks. Profiles are TOML data (profile_toml.py): the
shipped ones live in `profiles/`, a calibrated one wherever `save_profile` wrote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from meshforge.core.errors import Problem, RecipeError

# algorithm factor: bytes that cross each rank's link per byte of the full buffer (NCCL-tests' busbw)
RING = {"all_gather", "reduce_scatter", "all_to_all"}  # (n - 1) / n
WHOLE = {"broadcast", "send"}  # 1
KINDS = RING | WHOLE | {"all_reduce"}  # all_reduce: 2 (n - 1) / n
MAX_MODEL_RATE_SHARE = 4.0  # a step at 4x the probes' rates: the host's share misread, not a model
MAX_ARRIVAL_SKEW = 2.0  # waiting twice its computing time for its group: a misread, not a host
MAX_ARRIVAL_SKEW_CAP_S = 1.0  # a second late after however long a computation: a misread too


def cores_one_rank_uses(threads: int, cores: int) -> int:
    """CPU: the cores one rank alone uses: its threads, at most all the cores."""
    return min(max(1, threads), cores)


@dataclass(frozen=True)
class Link:
    """What one collective costs on a group: `latency_s + bytes * factor / bandwidth_Bps`."""

    latency_s: float  # fixed cost per collective, seconds
    bandwidth_Bps: float  # bus bandwidth, bytes/s (NCCL-tests' busbw convention)


@dataclass(frozen=True)
class Profile:
    """One machine (or cluster node) as the step-time model sees it. Compute rates are one rank's
    running alone; links are measured with every group of a size running its collective at once
    (so on a CPU they include the ranks' contention for the shared cores)."""

    name: str
    source: str  # how the numbers were obtained: host and date, or the citations
    matmul_flops: dict[str, float]  # compute dtype -> FLOP/s of one rank alone
    memory_Bps: float  # memory-bound ops of one rank alone: bytes read + written per second
    ranks_per_node: int  # ranks sharing a node: groups within it use `links`, across it `inter_node`
    shared_cores: int = 0  # CPU: the cores a node's ranks share (0: each rank has its own device)
    threads_per_rank: int = 1  # CPU: torch threads the rates were measured with
    links: dict[int, Link] = field(default_factory=dict)  # group size within a node -> its link
    inter_node: Link | None = None  # a group that spans nodes (InfiniBand on GPU clusters)
    calibrated_world: int = 0  # the world the links were measured in (0: vendor numbers)
    # host cost of each op a step dispatches (Python, autograd, dispatcher): what a CPU rank's small
    # ops cost beyond their bytes; 0 on a GPU, whose kernels launch ahead of the device
    op_overhead_s: float = 0.0
    # host cost of each op on DTensors (TP, CP, EP), beyond its local ops: DTensor's dispatch
    # (sharding propagation, wrapping) in Python; 0 on a GPU, hidden as op_overhead_s is
    dtensor_op_overhead_s: float = 0.0
    # host cost of one FSDP unit's hooks per microbatch, its forward and backward together, beyond
    # the ops they dispatch (unsharding, copy-in, resharding, reduce-scatter bookkeeping in Python)
    fsdp_unit_overhead_s: float = 0.0
    # host cost of one checkpointed block per microbatch, forward and backward together, beyond its
    # ops and the recompute's (the saved tensors' pack and unpack hooks in Python)
    checkpoint_overhead_s: float = 0.0
    peak_flops: dict[str, float] = field(default_factory=dict)  # compute dtype -> the peak MFU is against
    device_memory_gib: float = 0.0  # what fits (0: not judged, as on CPU ranks sharing host memory)
    # collective kind -> group size -> its own link, where one kind runs slower than the shared fit
    # (gloo's reduce_scatter); `links` otherwise
    kind_links: dict[str, dict[int, Link]] = field(default_factory=dict)
    # compute dtype -> FLOP/s of attention (SDPA forward and backward, FLOPs as torch's registry
    # counts them: a causal mask not discounted); a dtype without one is priced at matmul_rate
    attention_flops: dict[str, float] = field(default_factory=dict)
    # CPU: ranks computing at once, more than the cores -> how much longer each takes than its equal
    # share of the cores (context switches, caches refilled after each); 1 where not measured
    sharing_slowdown: dict[int, float] = field(default_factory=dict)
    # the share of the rates above that a model's step reaches (its operands cold, ops no probe
    # times): a reference Llama's step against them (rate_probes.model_rate_share); 1 where not
    # measured (a GPU's)
    model_rate_share: float = 1.0
    # CPU: group size -> the share of a rank's computing wall time since its last collective that its
    # next collective on such a group waits for the group's last rank beyond its link time (ranks
    # sharing cores arrive apart); 0 where not measured
    arrival_skew: dict[int, float] = field(default_factory=dict)
    # CPU: group size -> the most seconds that wait grows to, however long the computing (the
    # scheduler evens the ranks out within a few of its rounds); unbounded where not measured
    arrival_skew_cap: dict[int, float] = field(default_factory=dict)

    def core_share(self, computing: int) -> float:
        """Each rank's rate, as a share of its rate alone, while `computing` ranks compute on the
        shared cores: an equal share of them (a rank alone used at most all of them), slowed by
        `sharing_slowdown` (linear in the count from 1 at the count that fills the cores through
        the counts measured beyond it; the largest count's beyond them)."""
        per_rank = self.cores_per_rank
        if not self.shared_cores or computing * per_rank <= self.shared_cores:
            return 1.0
        full = self.shared_cores / per_rank
        counts = sorted(n for n in self.sharing_slowdown if n > full)  # a copied profile's may not be
        slowdown = float(
            np.interp(computing, [full, *counts], [1.0, *(self.sharing_slowdown[n] for n in counts)])
        )
        return self.shared_cores / (computing * per_rank) / slowdown

    def arrival_wait(self, group_size: int, computing_s: float) -> float:
        """Seconds a collective on `group_size` ranks waits for the group's last rank after a rank
        computed `computing_s` since its last collective: `arrival_skew` of it, at most
        `arrival_skew_cap` (each linear between measured sizes, the nearest's beyond them); 0 for a
        lone rank or where none was measured."""
        if group_size < 2 or not self.arrival_skew:
            return 0.0
        wait = _by_group(self.arrival_skew, group_size) * computing_s
        return min(wait, _by_group(self.arrival_skew_cap, group_size)) if self.arrival_skew_cap else wait

    @property
    def cores_per_rank(self) -> int:
        """CPU: the cores one rank alone used (its threads, at most all the cores)."""
        return cores_one_rank_uses(self.threads_per_rank, self.shared_cores)

    def unpriced(self, world: int, checkpointing: bool = True) -> list[str]:
        """What this profile leaves out of a step of `world` ranks for want of a measurement (a CPU
        profile calibrated before these were measured, a shipped GPU profile), to be said where it
        predicts (`checkpointing`: whether some step checkpoints blocks). A refined profile's fitted
        rates have taken the model's share in already."""
        missing = [] if self.fsdp_unit_overhead_s else ["FSDP's hooks per unit (fsdp_unit_overhead_s)"]
        if checkpointing and not self.checkpoint_overhead_s:
            missing.append("checkpointing's hooks per block (checkpoint_overhead_s)")
        shared = world * self.cores_per_rank > self.shared_cores
        if self.shared_cores and shared and not self.sharing_slowdown:
            missing.append("what ranks sharing the cores lose beyond their share (sharing_slowdown)")
        if self.shared_cores and world > 1 and not self.arrival_skew:
            missing.append("a collective's wait for its group's last rank (arrival_skew)")
        elif self.shared_cores and world > 1 and not self.arrival_skew_cap:
            missing.append("the most that wait grows to (arrival_skew_cap): it grows without bound")
        if self.shared_cores and self.model_rate_share == 1.0 and "refined by" not in self.source:
            missing.append("the share of the probes' rates a model's step reaches (model_rate_share)")
        return missing

    def attention_rate(self, dtype: str) -> float:
        """FLOP/s of attention in `dtype`: its own measured rate, else the matmul rate."""
        return self.attention_flops[dtype] if dtype in self.attention_flops else self.matmul_rate(dtype)

    def matmul_rate(self, dtype: str) -> float:
        """FLOP/s of a matmul in `dtype`; a dtype the profile has no rate for is refused."""
        if dtype not in self.matmul_flops:
            have = ", ".join(sorted(self.matmul_flops)) or "none"
            fix = f"the profile has rates for {have}; add matmul_flops.{dtype} or compute in one of those"
            raise RecipeError(
                [Problem("compute dtype", dtype, fix)], f"hardware profile {self.name}", "profile"
            )
        return self.matmul_flops[dtype]

    def link(self, group_size: int, crosses_nodes: bool) -> Link:
        """The link of a group of `group_size` ranks: `inter_node` as written when the group spans
        nodes; within a node the measured size, else the nearest measured size on a log scale
        (ties to the larger) with its latency scaled by (group_size - 1) / (measured - 1), a ring's
        steps, and its bus bandwidth kept (busbw does not depend on the group size for ring
        algorithms: that is what it is defined for)."""
        if group_size < 2:
            raise ValueError(f"a link joins 2 or more ranks, not {group_size}")
        if crosses_nodes:
            if self.inter_node is None:
                fix = f"add an [inter_node] table, or keep groups within {self.ranks_per_node} ranks"
                raise RecipeError(
                    [Problem("inter_node", None, fix)], f"hardware profile {self.name}", "profile"
                )
            return self.inter_node
        if group_size > self.ranks_per_node:
            raise ValueError(f"a group of {group_size} does not fit in a node of {self.ranks_per_node}")
        if group_size in self.links:
            return self.links[group_size]
        if not self.links:
            fix = "add [links.N] tables (N: a group size), or calibrate this machine with world > 1"
            raise RecipeError([Problem("links", {}, fix)], f"hardware profile {self.name}", "profile")
        near = min(self.links, key=lambda m: (abs(math.log2(m / group_size)), -m))
        link = self.links[near]
        return Link(link.latency_s * (group_size - 1) / (near - 1), link.bandwidth_Bps)

    def collective_time(self, kind: str, nbytes: int, group_size: int, crosses_nodes: bool = False) -> float:
        """Seconds of one collective on a group; `nbytes` is the full buffer one rank ends up with
        (all_gather) or starts from (reduce_scatter, all_reduce, all_to_all, broadcast, send)."""
        if kind not in KINDS:
            raise ValueError(f"unknown collective {kind!r}; known: {', '.join(sorted(KINDS))}")
        if nbytes < 0 or group_size < 1:
            raise ValueError(f"{kind} of {nbytes} bytes on a group of {group_size}")
        if group_size == 1:
            return 0.0
        own = self.kind_links.get(kind, {})
        link = (
            own[group_size]
            if group_size in own and not crosses_nodes
            else self.link(group_size, crosses_nodes)
        )
        return link.latency_s + nbytes * algorithm_factor(kind, group_size) / link.bandwidth_Bps


def algorithm_factor(kind: str, group_size: int) -> float:
    """Bytes each rank's link carries per byte of the full buffer (NCCL-tests' busbw factors)."""
    n = group_size
    return 1.0 if kind in WHOLE else (n - 1) / n * (2 if kind == "all_reduce" else 1)


def _by_group(values: dict[int, float], group_size: int) -> float:
    """A per-group-size figure at `group_size`: linear between the measured sizes."""
    sizes = sorted(values)
    return float(np.interp(group_size, sizes, [values[g] for g in sizes]))
