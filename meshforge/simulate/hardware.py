"""A hardware profile: how fast one rank computes and how fast its groups communicate.

The step-time model (`meshforge tune`) prices a traced step with it: matmuls at `matmul_rate`,
memory-bound ops at `memory_Bps`, every collective at `collective_time`. Rates are *achievable*
ones (measured by `simulate/calibrate.py`, or a vendor's peak scaled to what is reached in
practice, cited in the file), never raw datasheet peaks. Profiles are TOML data: the shipped ones
live in `profiles/`, a calibrated one wherever `save_profile` wrote it; unknown keys are refused.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import tomllib

from meshforge.core.errors import Problem, RecipeError, UsageError
from meshforge.parallelisms.fsdp import DTYPES

PROFILES = Path(__file__).parent / "profiles"
SHIPPED: dict[str, Path] = {p.stem: p for p in sorted(PROFILES.glob("*.toml"))}

# algorithm factor: bytes that cross each rank's link per byte of the full buffer (NCCL-tests' busbw)
RING = {"all_gather", "reduce_scatter", "all_to_all"}  # (n - 1) / n
WHOLE = {"broadcast", "send"}  # 1
KINDS = RING | WHOLE | {"all_reduce"}  # all_reduce: 2 (n - 1) / n


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

    def core_share(self, computing: int) -> float:
        """Each rank's rate, as a share of its rate alone, while `computing` ranks compute on the
        shared cores: an equal share of them (a rank alone used at most all of them), slowed by
        `sharing_slowdown` (linear in the count from 1 at the count that fills the cores through
        the counts measured beyond it; the largest count's beyond them)."""
        per_rank = min(max(1, self.threads_per_rank), self.shared_cores)  # cores a rank alone used
        if not self.shared_cores or computing * per_rank <= self.shared_cores:
            return 1.0
        full = self.shared_cores / per_rank
        counts = sorted(n for n in self.sharing_slowdown if n > full)  # a copied profile's may not be
        slowdown = float(
            np.interp(computing, [full, *counts], [1.0, *(self.sharing_slowdown[n] for n in counts)])
        )
        return self.shared_cores / (computing * per_rank) / slowdown

    def unpriced(self, world: int) -> list[str]:
        """What this profile leaves out of a step of `world` ranks for want of a measurement (a
        profile calibrated before 2026-12-05, a shipped GPU profile), to be said where it predicts."""
        missing = [] if self.fsdp_unit_overhead_s else ["FSDP's hooks per unit (fsdp_unit_overhead_s)"]
        per_rank = min(max(1, self.threads_per_rank), self.shared_cores)
        if self.shared_cores and world * per_rank > self.shared_cores and not self.sharing_slowdown:
            missing.append("what ranks sharing the cores lose beyond their share (sharing_slowdown)")
        if self.shared_cores and self.model_rate_share == 1.0:  # a CPU profile from before 2026-12-06
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


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (`h100`, `h200`) or a profile TOML file by path."""
    text = str(name_or_path)
    path = SHIPPED.get(text, Path(text).expanduser())
    if not path.is_file():
        hint = difflib.get_close_matches(Path(text).stem, SHIPPED, n=1)
        fix = f"did you mean {hint[0]}? " if hint else ""
        raise UsageError(
            f"hardware profile {text!r}: no such file or shipped profile; {fix}"
            f"shipped: {', '.join(SHIPPED)}, or a TOML file (meshforge tune --calibrate writes one)"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(
            [Problem("toml", str(path), f"not a TOML text file: {e}")], str(path), "profile"
        ) from None
    return profile_from_dict(data, f"hardware profile {path}")


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write `profile` as TOML that `load_profile` reads back equal, its source as a header too."""
    data: dict[str, Any] = {
        "name": profile.name,
        "source": profile.source,
        "ranks_per_node": profile.ranks_per_node,
        "shared_cores": profile.shared_cores,
        "threads_per_rank": profile.threads_per_rank,
        "calibrated_world": profile.calibrated_world,
        "op_overhead_s": profile.op_overhead_s,
        "dtensor_op_overhead_s": profile.dtensor_op_overhead_s,
        "fsdp_unit_overhead_s": profile.fsdp_unit_overhead_s,
        "model_rate_share": profile.model_rate_share,
        "device_memory_gib": profile.device_memory_gib,
        "memory_Bps": profile.memory_Bps,
        "matmul_flops": dict(profile.matmul_flops),
        "peak_flops": dict(profile.peak_flops),
        "attention_flops": dict(profile.attention_flops),
        "sharing_slowdown": {str(n): s for n, s in sorted(profile.sharing_slowdown.items())},
        "links": {str(n): _link_dict(link) for n, link in sorted(profile.links.items())},
        "kind_links": {
            kind: {str(n): _link_dict(link) for n, link in sorted(links.items())}
            for kind, links in profile.kind_links.items()
        },
    }
    if profile.inter_node is not None:
        data["inter_node"] = _link_dict(profile.inter_node)
    header = "".join(f"# {line}\n" for line in profile.source.splitlines())
    Path(path).write_text(f"# hardware profile {profile.name}\n{header}\n{tomli_w.dumps(data)}", "utf-8")


def _link_dict(link: Link) -> dict[str, float]:
    return {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v: Any) -> str | None:
    return None if _is_number(v) and v > 0 else "a number > 0"


def _non_negative(v: Any) -> str | None:
    return None if _is_number(v) and v >= 0 else "a number >= 0"


def _count(least: int):
    def check(v: Any) -> str | None:
        return (
            None
            if isinstance(v, int) and not isinstance(v, bool) and v >= least
            else f"an integer >= {least}"
        )

    return check


def _text(v: Any) -> str | None:
    return None if isinstance(v, str) and v.strip() else "a non-empty string"


# top-level key -> (required, check: what the value must be when it is wrong, else None)
SCALARS = {
    "name": (True, _text),
    "source": (True, _text),
    "memory_Bps": (True, _positive),
    "ranks_per_node": (True, _count(1)),
    "shared_cores": (False, _count(0)),
    "threads_per_rank": (False, _count(1)),
    "calibrated_world": (False, _count(0)),
    "op_overhead_s": (False, _non_negative),
    "dtensor_op_overhead_s": (False, _non_negative),
    "fsdp_unit_overhead_s": (False, _non_negative),
    "model_rate_share": (False, _positive),
    "device_memory_gib": (False, _non_negative),
}
TABLES = (
    "matmul_flops",
    "attention_flops",
    "peak_flops",
    "links",
    "kind_links",
    "inter_node",
    "sharing_slowdown",
)
LINK_KEYS = {"latency_s": (True, _non_negative), "bandwidth_Bps": (True, _positive)}


def profile_from_dict(data: dict, source: str) -> Profile:
    """A Profile from a profile file's data; every problem (an unknown or missing key, a bad
    value) is reported at once, each naming its key."""
    problems: list[Problem] = []

    def check_keys(where: str, table: dict, known: dict, extra: tuple[str, ...] = ()) -> None:
        """Unknown keys refused by name; missing required ones and bad values reported."""
        for key in sorted(table.keys() - known.keys() - set(extra)):
            hint = difflib.get_close_matches(key, [*known, *extra], n=1)
            fix = f"did you mean {hint[0]}? " if hint else ""
            problems.append(
                Problem(where + key, table[key], f"unknown key; {fix}known: {', '.join([*known, *extra])}")
            )
        for key, (required, check) in known.items():
            if key in table and (fix := check(table[key])):
                problems.append(Problem(where + key, table[key], f"must be {fix}"))
            elif key not in table and required:
                problems.append(Problem(where + key, None, f"missing: {check(None)}"))

    def link(where: str, value: Any) -> Link | None:
        if not isinstance(value, dict):
            problems.append(Problem(where, value, "a table with latency_s and bandwidth_Bps"))
            return None
        found = len(problems)
        check_keys(where + ".", value, LINK_KEYS)
        return (
            Link(float(value["latency_s"]), float(value["bandwidth_Bps"])) if len(problems) == found else None
        )

    def table(key: str, what: str) -> dict:
        value = data.get(key, {})
        if not isinstance(value, dict):
            problems.append(Problem(key, value, f"a table of {what}"))
        return value if isinstance(value, dict) else {}

    check_keys("", data, SCALARS, TABLES)
    rates = table("matmul_flops", "FLOP/s by compute dtype")
    check_keys("matmul_flops.", rates, {dtype: (False, _positive) for dtype in DTYPES})
    if not rates:
        problems.append(Problem("matmul_flops", rates, f"a rate for one of {', '.join(DTYPES)} at least"))
    peaks = table("peak_flops", "peak FLOP/s by compute dtype")
    check_keys("peak_flops.", peaks, {dtype: (False, _positive) for dtype in DTYPES})
    attention = table("attention_flops", "attention FLOP/s by compute dtype")
    check_keys("attention_flops.", attention, {dtype: (False, _positive) for dtype in DTYPES})
    slowdowns = table("sharing_slowdown", "slowdowns by the count of ranks computing at once")
    for count, v in slowdowns.items():
        if not count.isdigit() or int(count) < 2 or not _is_number(v) or v < 1:
            fix = "a count of ranks (an integer >= 2) = a slowdown >= 1 ([sharing_slowdown] 8 = 1.25)"
            problems.append(Problem(f"sharing_slowdown.{count}", v, fix))
    per_node = data.get("ranks_per_node")

    def sized_links(where: str, value: dict) -> dict[int, Link]:
        out = {}
        for size, v in value.items():
            if not size.isdigit() or int(size) < 2:
                problems.append(Problem(f"{where}.{size}", v, f"a group size: an integer >= 2 ([{where}.8])"))
            elif isinstance(per_node, int) and int(size) > per_node:
                problems.append(
                    Problem(f"{where}.{size}", v, f"not a group within a node of {per_node} ranks")
                )
            elif (parsed := link(f"{where}.{size}", v)) is not None:
                out[int(size)] = parsed
        return out

    links = sized_links("links", table("links", "links by group size"))
    kind_links = {}
    for kind, value in table("kind_links", "links by collective kind and group size").items():
        if kind not in KINDS:
            problems.append(
                Problem(f"kind_links.{kind}", value, f"a collective: one of {', '.join(sorted(KINDS))}")
            )
        elif isinstance(value, dict):
            kind_links[kind] = sized_links(f"kind_links.{kind}", value)
    inter_node = link("inter_node", data["inter_node"]) if "inter_node" in data else None
    if problems:
        raise RecipeError(problems, source, "profile")
    return Profile(
        name=data["name"],
        source=data["source"],
        matmul_flops={dtype: float(rate) for dtype, rate in rates.items()},
        memory_Bps=float(data["memory_Bps"]),
        ranks_per_node=data["ranks_per_node"],
        shared_cores=data.get("shared_cores", 0),
        threads_per_rank=data.get("threads_per_rank", 1),
        links=links,
        inter_node=inter_node,
        calibrated_world=data.get("calibrated_world", 0),
        op_overhead_s=float(data.get("op_overhead_s", 0.0)),
        dtensor_op_overhead_s=float(data.get("dtensor_op_overhead_s", 0.0)),
        fsdp_unit_overhead_s=float(data.get("fsdp_unit_overhead_s", 0.0)),
        model_rate_share=float(data.get("model_rate_share", 1.0)),
        peak_flops={dtype: float(rate) for dtype, rate in peaks.items()},
        attention_flops={dtype: float(rate) for dtype, rate in attention.items()},
        sharing_slowdown={int(n): float(s) for n, s in slowdowns.items()},
        device_memory_gib=float(data.get("device_memory_gib", 0.0)),
        kind_links=kind_links,
    )
