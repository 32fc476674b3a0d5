"""Hardware profiles as TOML: the shipped ones (`profiles/`), loaded by name or path and checked
key by key (unknown keys refused, each bad value named with what it must be), and written back so
that they load equal."""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from meshforge.core.errors import Problem, RecipeError, UsageError
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.simulate.hardware import (
    KINDS,
    MAX_ARRIVAL_SKEW,
    MAX_ARRIVAL_SKEW_CAP_S,
    MAX_MODEL_RATE_SHARE,
    Link,
    Profile,
)

PROFILES = Path(__file__).parent / "profiles"
SHIPPED: dict[str, Path] = {p.stem: p for p in sorted(PROFILES.glob("*.toml"))}


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
        "checkpoint_overhead_s": profile.checkpoint_overhead_s,
        "model_rate_share": profile.model_rate_share,
        "device_memory_gib": profile.device_memory_gib,
        "memory_Bps": profile.memory_Bps,
        "matmul_flops": dict(profile.matmul_flops),
        "peak_flops": dict(profile.peak_flops),
        "attention_flops": dict(profile.attention_flops),
        "sharing_slowdown": {str(n): s for n, s in sorted(profile.sharing_slowdown.items())},
        "arrival_skew": {str(g): f for g, f in sorted(profile.arrival_skew.items())},
        "arrival_skew_cap": {str(g): s for g, s in sorted(profile.arrival_skew_cap.items())},
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


def _share(v: Any) -> str | None:
    bound = MAX_MODEL_RATE_SHARE
    return None if _is_number(v) and 0 < v <= bound else f"a number > 0 and <= {bound:g} (calibrate's bound)"


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
    "checkpoint_overhead_s": (False, _non_negative),
    "model_rate_share": (False, _share),
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
    "arrival_skew",
    "arrival_skew_cap",
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

    def by_group(where: str, what: str, bound: float, example: str) -> dict:
        values = table(where, f"{what}, by group size")
        for size, v in values.items():
            if not size.isdigit() or int(size) < 2 or not _is_number(v) or not 0 <= v <= bound:
                fix = f"a group size (an integer >= 2) = {what} in [0, {bound}] ([{where}] 8 = {example})"
                problems.append(Problem(f"{where}.{size}", v, fix))
        return values

    skews = by_group("arrival_skew", "a share of the computing time", MAX_ARRIVAL_SKEW, "0.3")
    caps = by_group("arrival_skew_cap", "seconds", MAX_ARRIVAL_SKEW_CAP_S, "0.03")
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
        checkpoint_overhead_s=float(data.get("checkpoint_overhead_s", 0.0)),
        model_rate_share=float(data.get("model_rate_share", 1.0)),
        peak_flops={dtype: float(rate) for dtype, rate in peaks.items()},
        attention_flops={dtype: float(rate) for dtype, rate in attention.items()},
        sharing_slowdown={int(n): float(s) for n, s in slowdowns.items()},
        arrival_skew={int(g): float(f) for g, f in skews.items()},
        arrival_skew_cap={int(g): float(c) for g, c in caps.items()},
        device_memory_gib=float(data.get("device_memory_gib", 0.0)),
        kind_links=kind_links,
    )
