"""`meshforge tune --calibrate-from RUNS`: a hardware profile refined by runs that were measured.

Each finished run (a sweep's or a tune's points, or plain runs: any folder `compare` reads) is
traced again from the recipe it saved (its `recipe.toml`, on its world), and its steady step time
read as `compare` reads it. Six multipliers of the profile's constants (matmul rates, attention's
with them, memory bandwidth, host cost per op and per DTensor op, link latencies, link bandwidths)
are fitted so the predicted steps match the measured ones, by least squares on log(predicted /
measured): every run weighs the same whatever its length. The runs' misses are mostly the model's
own, shared by the layouts that have the same shape (not independent noise): so they weigh
together as one run (their mean square), a pull towards 1 keeps a constant where calibration put
it unless the runs on the whole ask to move it, and a run missed by far more than the rest counts
less than its square (soft L1) rather than dragging every constant after it. The step-time model
itself is unchanged (step_time.py): the fit moves only its constants.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from scipy.optimize import least_squares

from meshforge.core.errors import UsageError
from meshforge.core.tables import wide
from meshforge.core.topology import ParallelDims
from meshforge.experiments.compare import find_runs
from meshforge.recipe import load_recipe
from meshforge.simulate.estimate import role_works, submit_roles, trace_pool
from meshforge.simulate.hardware import Link, Profile
from meshforge.simulate.profile_toml import save_profile
from meshforge.simulate.step_time import predict_step

FACTORS = ("matmul", "memory", "op_host", "dtensor_host", "latency", "bandwidth")
# residual per unit of log(factor): a 2x factor weighs as a 7% miss on every run. Summed over runs
# (each its own residual, this pull weighing as one run's), debug_cpu's 84 runs pulled bandwidth to
# x0.1-0.14 and memory to x0.1, and llm_1b predicted by that missed by 41-95% (on 84 and
# 68 runs of benchmarks/tune_accuracy.py, layouts x schedule x AC): with the runs' mean square and
# soft L1, 8.1% and 11.7% (calibration alone: 5.6% and 11.3%); pull 0.03 12% and 12%, 0.3 6.4% and 11.2%
PULL = 0.1
ROBUST_SCALE = 0.1  # soft L1: a miss beyond ~10% counts linearly, not squared
LIMIT = math.log(10.0)  # no constant moves more than 10x either way


@dataclasses.dataclass
class MeasuredRun:
    """A finished run as the fit sees it: its roles' traced work and its steady step time."""

    name: str
    works: dict[int, dict]  # pp rank -> the traced work (trace.trace_rank's "work")
    dims: ParallelDims
    grad_accum: int
    step_s: float
    tokens_per_step: int  # the global batch's tokens: what a step time is a rate of

    def predict(self, profile: Profile) -> float:
        return predict_step(self.works, self.dims, self.grad_accum, profile).step_s


def scaled(profile: Profile, factors: dict[str, float]) -> Profile:
    """`profile` with each constant multiplied by its factor (FACTORS); rates scale up, costs down."""

    def link(k: Link) -> Link:
        return Link(k.latency_s * factors["latency"], k.bandwidth_Bps * factors["bandwidth"])

    return dataclasses.replace(
        profile,
        matmul_flops={d: r * factors["matmul"] for d, r in profile.matmul_flops.items()},
        attention_flops={d: r * factors["matmul"] for d, r in profile.attention_flops.items()},
        memory_Bps=profile.memory_Bps * factors["memory"],
        op_overhead_s=profile.op_overhead_s * factors["op_host"],
        dtensor_op_overhead_s=profile.dtensor_op_overhead_s * factors["dtensor_host"],
        fsdp_unit_overhead_s=profile.fsdp_unit_overhead_s * factors["op_host"],  # the host's Python, as ops
        checkpoint_overhead_s=profile.checkpoint_overhead_s * factors["op_host"],
        links={n: link(k) for n, k in profile.links.items()},
        kind_links={kind: {n: link(k) for n, k in ls.items()} for kind, ls in profile.kind_links.items()},
        inter_node=link(profile.inter_node) if profile.inter_node else None,
    )


def measured_runs(paths: list[Path], console: Console) -> list[MeasuredRun]:
    """Every finished run under `paths` with a steady step time, traced again; runs the fit cannot
    use (no steady steps, the JAX backend) are named and left out."""
    if missing := [str(p) for p in paths if not p.is_dir()]:
        raise UsageError(
            f"--calibrate-from {' '.join(missing)}: no such folder; pass run, sweep or tune folders"
        )
    runs, pending = [], []
    with trace_pool() as pool:
        for run in find_runs(paths):
            step = run.throughput()["step_time"]
            recipe_file = run.path / "recipe.toml"
            why = (
                "no steady step time (too few steps, or it failed)"
                if not step
                else "no recipe.toml"
                if not recipe_file.is_file()
                else "backend jax: the trace is torch's"
                if run.info["recipe"].get("backend") == "jax"
                else None
            )
            if why:
                console.print(f"  {run.path}: left out: {why}", highlight=False)
                continue
            recipe = load_recipe(recipe_file, world_size=run.info["world_size"])
            pending.append((run, recipe, step, submit_roles(recipe, pool, work=True)))
        for run, recipe, step, traces in pending:
            dims = ParallelDims.from_config(recipe.mesh)
            works = role_works(traces, dims)
            name = f"{run.path.parent.name}/{run.name}"
            tokens = recipe.train.global_batch_size * recipe.train.seq_len
            runs.append(MeasuredRun(name, works, dims, recipe.train.grad_accum_steps, step, tokens))
    if not runs:
        raise UsageError(f"--calibrate-from {' '.join(map(str, paths))}: no finished run with steady steps")
    return runs


def fit_factors(runs: list[MeasuredRun], profile: Profile) -> dict[str, float]:
    """The FACTORS that bring the runs' predicted steps nearest their measured ones (module doc)."""

    def residuals(logs: np.ndarray) -> np.ndarray:
        p = scaled(profile, dict(zip(FACTORS, np.exp(logs))))
        misses = np.array([math.log(max(r.predict(p), 1e-12) / r.step_s) for r in runs])
        return np.concatenate([_soft_l1(misses) / math.sqrt(len(runs)), PULL * logs])

    fit = least_squares(residuals, np.zeros(len(FACTORS)), bounds=(-LIMIT, LIMIT), diff_step=1e-3)
    return {name: float(math.exp(v)) for name, v in zip(FACTORS, fit.x)}


def _soft_l1(misses: np.ndarray) -> np.ndarray:
    """Residuals whose squares are scipy's soft L1 loss of `misses` (C^2 x 2(sqrt(1 + (m/C)^2) - 1),
    C = ROBUST_SCALE): about the miss near 0, its square growing only linearly beyond C. Written
    without the difference, which cancels for tiny misses; applied here so the pull stays squared."""
    return misses * np.sqrt(2 / (1 + np.sqrt(1 + (misses / ROBUST_SCALE) ** 2)))


def refine(profile: Profile, paths: list[Path], console: Console) -> Profile:
    """`profile` refined by the runs under `paths`: fitted, its provenance extended, and a table of
    each run's measured step next to the prediction before and after printed."""
    runs = measured_runs(paths, console)
    factors = fit_factors(runs, profile)
    refined = scaled(profile, factors)
    before = [r.predict(profile) / r.step_s - 1 for r in runs]
    after = [r.predict(refined) / r.step_s - 1 for r in runs]
    wide(console).print(_fit_table(runs, before, after, factors, profile.name))
    moved = _factors_text(factors, flag_bound=False)
    source = (
        f"{profile.source}\nrefined by {len(runs)} measured runs ({', '.join(map(str, paths))}): {moved}; "
        f"median |error| {_median_abs(before):.1%} -> {_median_abs(after):.1%}"
    )
    return dataclasses.replace(refined, name=f"{profile.name}+runs", source=source)


def _median_abs(errors: list[float]) -> float:
    return float(np.median(np.abs(errors)))


def _factors_text(factors: dict[str, float], flag_bound: bool) -> str:
    """'matmul x1.2, ...', with `flag_bound` saying which factor stopped at the LIMIT."""
    bound = math.exp(LIMIT) * (1 - 1e-6)
    return ", ".join(
        f"{k} x{v:.3g}"
        + (f" (at the {math.exp(LIMIT):.0f}x bound)" if flag_bound and max(v, 1 / v) >= bound else "")
        for k, v in factors.items()
    )


def _fit_table(runs, before, after, factors, name: str) -> Table:
    table = Table(title=f"profile {name} refined by {len(runs)} runs", title_justify="left")
    for col in ("run", "measured step s", "error before (predicted / measured - 1)", "error after"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r, b, a in zip(runs, before, after):
        table.add_row(r.name, f"{r.step_s:.4f}", f"{b:+.1%}", f"{a:+.1%}")
    table.caption = "factors: " + _factors_text(factors, flag_bound=True)
    return table


def refined_profile(profile: Profile, runs: list[Path], console: Console) -> Profile:
    """`profile` refined by the measured runs under `runs`, written to
    ./meshforge-profile-<name>.toml for the next tune's --profile."""
    refined = refine(profile, runs, console)
    path = Path(f"meshforge-profile-{profile_file_stem(refined.name)}.toml")
    save_profile(refined, path)
    console.print(f"refined profile written to {path} (--profile {path} uses it again)", highlight=False)
    return refined


def profile_file_stem(name: str) -> str:
    """A profile's name as a file name a shell takes unquoted: a GPU's calibrated profile is named
    for its device ("NVIDIA H200"), so runs of other characters become one '-'."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", name).strip("-") or "profile"
