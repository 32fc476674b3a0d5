"""`meshforge estimate`: per-rank peak memory of a recipe (or of every mesh of a world
size) before launching, with no devices and no real allocation.

Traced: one rank per distinct role (one per pipeline stage; data- and tensor-parallel
peers hold the same shapes) is simulated under torch's fake process group, with the
parallelized model on fake tensors (FakeTensorMode). A steady-state training step
(optimizer moments already allocated) runs under torch's MemTracker, so parameters,
gradients, optimizer state, activations, FSDP buffers and temporaries are counted as
the real step allocates them. Under pipeline parallelism the rank's forwards and
backwards run in the schedule's own action order, so the microbatches a schedule keeps
in flight are alive at once, and FSDP is driven as torch's PipelineStage drives it.
A deep stage is traced shallow and one period (a block, or selective AC's period) deeper,
both in one worker (the second runs on what torch cached for the first), and extrapolated to
its depth (submit_trace). Measured against real runs by
benchmarks/estimator_accuracy.py.

Analytic, beside it: model states at 16 bytes/parameter (fp32 params + grads + AdamW
moments) over the sharding, plus Korthikanti et al. 2022 activations (run/rank/analytic.py).

With `fsdp.cpu_offload` both count the device only: the sharded parameters, their gradients
and the optimizer state live on the host (`host`, for the machine check), so the traced peak
loses them (`off_the_device`) and the analytic states are 0 on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from meshforge.configs import Recipe, RecipeError, RecipeLike, RecipeSource, ac_policy, load_config
from meshforge.core.errors import NothingProduced
from meshforge.core.tables import add_name_column, wide
from meshforge.core.topology import ParallelDims
from meshforge.core.units import GiB
from meshforge.models import args_from_config
from meshforge.parallelisms.pp import stage_ids_for_rank, stage_layout
from meshforge.recipe import experts_of, load_recipe
from meshforge.run.observe.memtrace import CATEGORIES
from meshforge.run.rank.plan import make_plan
from meshforge.simulate.fake_rank import trace_pool
from meshforge.simulate.hardware import Profile
from meshforge.simulate.step_time import StepPrediction, predict_step
from meshforge.simulate.trace import FROM_START_PERIODS, trace_depths, trace_rank

# A deep stage is traced at a shallow depth and one period deeper: memory grows by the same
# amount with each further block (its parameters, gradients, moments and saved activations), so
# the two traces give the slope and the real depth is extrapolated (checked against full traces
# in tests/plan/test_memory.py), at each place of the step on its own (trace.block_locator). At least
# 4 periods: the first two and the last two blocks differ from the rest (FSDP's prefetch of the
# next block, the first block's gradient buckets), so each is traced at both depths.
MIN_SHALLOW_PERIODS = 2 * FROM_START_PERIODS


class Extrapolated:
    """Two shallow traces of a rank (one future of both, trace_depths, or a future of each),
    extrapolated to the real depth by `result()`."""

    def __init__(self, traces: list, periods: float):
        self.traces, self.periods = traces, periods

    def result(self) -> dict:
        """Every phase's peak extrapolated on its own (the step's peak can move to another phase
        with depth: llm_1b cp4-pp2 and qwen3_30b_a3b dp8 did), the highest of them."""
        done = [t.result() for t in self.traces]
        low_trace, high_trace = done[0] if len(done) == 1 else done
        low, high = low_trace["phases"], high_trace["phases"]
        if missing := [p for p in low if p not in high]:  # a label that moved: the extrapolation is off
            raise RuntimeError(f"estimate: places of the shallow trace missing one period deeper: {missing}")
        deep = [
            {k: max(0, round(low[p][k] + (high[p][k] - low[p][k]) * self.periods)) for k in low[p]}
            for p in low
            if p in high
        ]
        peak = max(deep, key=lambda c: c["total"])  # a tie: the first in the step, as a tracker
        if "work" not in high_trace:
            return peak
        return {**peak, "work": extrapolate_work(low_trace["work"], high_trace["work"], self.periods)}


def extrapolate_work(low: dict, high: dict, periods: float) -> dict:
    """A trace's work (op_costs) at the real depth: each phase's FLOPs, bytes, op and collective
    counts grow by the same amount with each further period, as its memory does."""

    def line(a: float, b: float) -> float:
        return max(0.0, a + (b - a) * periods)

    costs = {}
    for phase, hi in high["costs"].items():
        lo = low["costs"].get(phase, {"memory_bytes": 0, "ops": 0, "collectives": []})
        costs[phase] = {
            **{
                key: {d: line(lo.get(key, {}).get(d, 0.0), f) for d, f in hi.get(key, {}).items()}
                for key in ("flops", "attention_flops")
            },
            "memory_bytes": line(lo["memory_bytes"], hi["memory_bytes"]),
            "ops": line(lo["ops"], hi["ops"]),
            "dtensor_ops": line(lo.get("dtensor_ops", 0), hi.get("dtensor_ops", 0)),
            "fsdp_units": line(lo.get("fsdp_units", 0), hi.get("fsdp_units", 0)),
            "checkpointed_blocks": line(lo.get("checkpointed_blocks", 0), hi.get("checkpointed_blocks", 0)),
            "collectives": _grow_collectives(lo["collectives"], hi["collectives"], line),
        }
    return {**high, "costs": costs}


def _grow_collectives(low: list, high: list, line: Callable[[float, float], float]) -> list:
    """Collectives at the real depth: a block's repeat, so each (kind, bytes, group, overlapped)
    grows in count; one whose size grows with depth instead (the gradient norm's, a float per
    parameter) has no twin of its size at the other depth: matched by kind, group and count, its
    bytes larger at the deeper trace, its bytes grow."""
    counts = {tuple(c[:-1]): c[-1] for c in low}
    grown = {tuple(c[:-1]): c[-1] for c in high}
    out = [[*key, line(counts[key], grown[key])] for key in counts if key in grown]
    lone = [key for key in counts if key not in grown]
    for key in (k for k in grown if k not in counts):
        twin = next(
            (
                k
                for k in lone
                if (k[0], *k[2:]) == (key[0], *key[2:]) and counts[k] == grown[key] and k[1] < key[1]
            ),
            None,
        )
        if twin is None:
            out.append([*key, line(0, grown[key])])
            continue
        lone.remove(twin)
        out.append([key[0], round(line(twin[1], key[1])), *key[2:], grown[key]])
    return out + [[*key, line(counts[key], 0)] for key in lone]


def submit_trace(recipe: Recipe, rank: int, pool, work: bool = False, paired: bool = True):
    """Rank `rank`'s traced peak (a future), with its work if `work` (step-time prediction):
    traced at the recipe's depth, or, where that costs more, at a shallow depth and one period
    deeper and extrapolated linearly (Extrapolated). `paired`: both shallow traces in one worker
    (less work in all, for many traces); otherwise each in its own (sooner, for one).
    The period is 1 block, or `selective_every` under selective AC (checkpointed by layer id):
    shallow stages keep their block count and first layer id modulo the period, so the same
    blocks are checkpointed. Each trace (or shallow pair) runs in its own worker process (trace_pool)."""
    dims = ParallelDims.from_config(recipe.mesh)
    counts = [len(ids) for ids in stage_layout_of(recipe, dims)]
    period = ac_policy(recipe.activation_checkpoint).period
    least = MIN_SHALLOW_PERIODS * period
    low = [min(n, least + (n - least) % period) for n in counts]
    mine = (
        stage_ids_for_rank(
            dims.coordinate(rank)["pp"], dims.pp, recipe.pp.stages_per_rank, recipe.pp.schedule
        )
        if dims.pp_enabled
        else [0]
    )
    grown = [s for s in mine if low[s] < counts[s]]
    # every grown stage of the rank lacks the same number of blocks, so the extrapolation is
    # exact whatever each stage's own slope (interleaved stages keep different microbatches alive)
    missing = min((counts[s] - low[s] for s in grown), default=0)
    for s in grown:
        low[s] = counts[s] - missing
    high = [lo + period if lo < n else n for lo, n in zip(low, counts)]
    if sum(low[s] + high[s] for s in mine) >= sum(counts[s] for s in mine):  # no cheaper
        return pool.submit(trace_rank, recipe, rank, work)
    shallow = [_with_stage_blocks(recipe, dims, c) for c in (low, high)]  # `high` adds a period to each
    if paired:
        return Extrapolated([pool.submit(trace_depths, shallow, rank, work)], missing / period)
    return Extrapolated([pool.submit(trace_rank, r, rank, work) for r in shallow], missing / period)


def stage_layout_of(recipe: Recipe, dims: ParallelDims) -> list[list[int]]:
    """Layer ids per pipeline stage (one stage without pipelining)."""
    n_layers = args_from_config(recipe.model).n_layers
    if not dims.pp_enabled:
        return [list(range(n_layers))]
    return stage_layout(n_layers, dims.pp * recipe.pp.stages_per_rank, recipe.pp)


def _with_stage_blocks(recipe: Recipe, dims: ParallelDims, counts: list[int]) -> Recipe:
    """The recipe with `counts[s]` blocks in stage s (explicit layers_per_stage under pipelining)."""
    model = dataclasses.replace(recipe.model, n_layers=sum(counts))
    pp = dataclasses.replace(recipe.pp, layers_per_stage=list(counts)) if dims.pp_enabled else recipe.pp
    return dataclasses.replace(recipe, model=model, pp=pp)


def traced_estimate(recipe: Recipe, pool) -> dict:
    """The heaviest role's categories, with `rank` saying which global rank it is."""
    return heaviest(submit_roles(recipe, pool, paired=False))


def submit_roles(recipe: Recipe, pool, work: bool = False, paired: bool = True) -> list:
    """One trace per distinct role of the mesh, started on `pool` (trace_pool), with each role's
    work if `work`; `heaviest` collects them, so many recipes' traces can run at once (`paired`:
    submit_trace)."""
    return [
        (rank, submit_trace(recipe, rank, pool, work, paired))
        for rank in ParallelDims.from_config(recipe.mesh).role_ranks()
    ]


def role_works(results: list, dims: ParallelDims) -> dict[int, dict]:
    """Each pp rank's traced work from `submit_roles(..., work=True)`: what predict_step prices."""
    return {dims.coordinate(rank)["pp"]: r.result()["work"] for rank, r in results}


def predict_recipe_step(recipe: Recipe, profile: Profile) -> StepPrediction:
    """One recipe's step as `meshforge tune --plan` predicts it: its roles traced with their work
    (a pool of its own), priced by `profile`."""
    dims = ParallelDims.from_config(recipe.mesh)
    with trace_pool() as pool:
        works = role_works(submit_roles(recipe, pool, work=True), dims)
    return predict_step(works, dims, recipe.train.grad_accum_steps, profile)


def heaviest(results: list) -> dict:
    per_role = [
        {k: v for k, v in r.result().items() if k not in ("phases", "work")} | {"rank": rank}
        for rank, r in results
    ]
    return max(per_role, key=lambda p: p["total"])


def analytic_figures(plan) -> dict[str, int]:
    """The analytic estimate's bytes per rank, as the estimate and sweep tables show them."""
    return {
        "states": plan.state_bytes_per_rank,
        "activations": plan.activation_bytes_per_rank,
        "total": plan.bytes_per_rank,
        "host": plan.host_state_bytes_per_rank,
    }


def estimate_rows(
    source: RecipeLike, overrides: list[str], world: int, all_meshes: bool, traced: bool = True
) -> list[dict]:
    """One row per mesh: the analytic figures, and (traced=True) the traced heaviest rank."""
    rows, pending, meshes = [], [], [None]
    if all_meshes:
        meshes = ParallelDims.all_of_world(world, experts_of(load_config(source, overrides)[0]))
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(trace_pool()) if traced else None
        for mesh in meshes:
            extra = mesh.overrides() if mesh else []
            try:
                recipe = load_recipe(source, [*overrides, *extra], world_size=world)
            except RecipeError as e:
                rows.append({"layout": mesh.label() if mesh else "recipe", "refused": str(e.problems[0])})
                continue
            plan = make_plan(recipe)
            row = {
                "layout": plan.dims.label(),
                "analytic": analytic_figures(plan),
            }
            rows.append(row)
            if traced:  # one recipe's shallow pairs in parallel, many recipes' each in one worker
                pending.append((row, submit_roles(recipe, pool, paired=all_meshes)))
        for row, results in pending:
            row["traced"] = heaviest(results)
    for row in rows:
        if "analytic" in row:
            row["total"] = row["traced"]["total"] if "traced" in row else row["analytic"]["total"]
    return sorted(rows, key=lambda r: r.get("total", float("inf")))


SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "communication": "comm",
    "temporaries": "temp",
}


def estimate_table(rows: list[dict], device_memory: float | None) -> Table:
    """Traced peak of the heaviest rank by category, the analytic total beside it, and fit."""
    traced = any("traced" in r for r in rows)
    title = "estimated peak memory per rank, GiB " + (
        "(traced heaviest rank; analytic beside it)" if traced else "(analytic)"
    )
    if device_memory:
        title += f", device {device_memory / GiB:.0f} GiB"
    table = Table(title=title)
    columns = []  # beside the layout's
    if traced:
        columns += ["peak", "rank", *SHORT.values()]
    offload = any(r.get("analytic", {}).get("host") for r in rows)
    columns += ["analytic states", "analytic activations", "analytic total"]
    columns += ["host (offloaded states)"] * offload + ["fits"]
    add_name_column(table, "layout", (r["layout"] for r in rows if "refused" not in r))
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        if "refused" in r:
            continue  # listed under the table (estimate_refusals)
        cells = [r["layout"]]
        if traced:
            t = r["traced"]
            cells += [f"{t['total'] / GiB:.2f}", str(t["rank"]), *[f"{t[c] / GiB:.2f}" for c in CATEGORIES]]
        a = r["analytic"]
        fits = "" if device_memory is None else ("yes" if r["total"] <= device_memory else "[red]no[/]")
        cells += [
            f"{a['states'] / GiB:.2f}",
            f"{a['activations'] / GiB:.2f}",
            f"{a['total'] / GiB:.2f}",
            *[f"{a['host'] / GiB:.2f}"] * offload,
            fits,
        ]
        table.add_row(*cells)
    return table


def estimate_refusals(rows: list[dict]) -> list[str]:
    """One line per refused layout: why validation refuses it."""
    return [f"{r['layout']}: refused: {r['refused']}" for r in rows if "refused" in r]


def print_estimate(
    recipe_path: str,
    overrides: list[str],
    world: int,
    all_meshes: bool,
    analytic: bool,
    device_memory: float | None,
    console: Console,
) -> None:
    """`meshforge estimate`: the table (wide when not on a terminal) and the refused layouts."""
    source = RecipeSource.read(recipe_path)  # read once: every mesh is it and its overrides
    rows = estimate_rows(source, overrides, world, all_meshes, traced=not analytic)
    if not any("analytic" in r for r in rows):
        raise NothingProduced(nothing_estimated(rows, world, console))
    out = wide(console)
    out.print(estimate_table(rows, device_memory))
    for line in estimate_refusals(rows) + estimate_caveats(load_config(source, overrides)[0]):
        out.print(line, highlight=False, soft_wrap=True)


def nothing_estimated(rows: list[dict], world: int, console: Console) -> str:
    """The one line of an estimate with no layout left: the refusal itself, or (several layouts)
    a count, their refusals printed above it."""
    if len(rows) == 1:
        return f"nothing estimated: {rows[0]['layout']} refused: {rows[0]['refused']}"
    for line in estimate_refusals(rows):
        wide(console).print(line, highlight=False, soft_wrap=True)
    return f"nothing estimated: all {len(rows)} layouts of {world} ranks were refused (each listed above)"


def estimate_caveats(recipe: Recipe) -> list[str]:
    """What the trace cannot see of this recipe, said under the table."""
    if not ac_policy(recipe.activation_checkpoint).by_compiler:
        return []
    return [
        "activation_checkpoint.mode = memory_budget: traced eager (the compiler's partitioner, which "
        "recomputes within the budget, does not run on fake tensors): activations are an upper bound"
    ]
