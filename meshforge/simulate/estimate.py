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
and extrapolated to its depth (submit_trace). Measured against real runs by
benchmarks/estimator_accuracy.py.

Analytic, beside it: model states at 16 bytes/parameter (fp32 params + grads + AdamW
moments) over the sharding, plus Korthikanti et al. 2022 activations (run/launch/analytic.py).

With `fsdp.cpu_offload` both count the device only: the sharded parameters, their gradients
and the optimizer state live on the host (`host`, for the machine check), so the traced peak
loses them (`off_the_device`) and the analytic states are 0 on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshforge.configs import Recipe, RecipeError, load_config
from meshforge.core.topology import ParallelDims
from meshforge.core.units import GiB
from meshforge.models import args_from_config
from meshforge.parallelisms import to_empty
from meshforge.parallelisms.fsdp import DTYPES, fsdp_applies, quiet_embedding_view_warning
from meshforge.parallelisms.pp import build_schedule, stage_ids_for_rank, stage_layout
from meshforge.parallelisms.pp_actions import parse_action, pipeline_order
from meshforge.recipe import experts_of, load_recipe
from meshforge.run.launch.plan import make_plan
from meshforge.run.observe.memtrace import CATEGORIES, make_tracker, peak_categories
from meshforge.run.train.optim import build_optimizer
from meshforge.run.train.step import StepPolicy, cross_entropy_sum
from meshforge.simulate.fake_rank import isolated_sharding_propagation, simulated_rank, trace_pool

# A deep stage is traced at a shallow depth and one period deeper: memory grows by the same
# amount with each further block (its parameters, gradients, moments and saved activations), so
# the two traces give the slope and the real depth is extrapolated (checked against full traces
# in tests/test_memory.py). At least 2 periods: the first differs from the rest (FSDP's prefetch
# of the next block, the first block's gradient buckets), measured on the debug model.
MIN_SHALLOW_PERIODS = 2


class Extrapolated:
    """Two shallow traces of a rank (futures), extrapolated to the real depth by `result()`."""

    def __init__(self, low, high, periods: float):
        self.low, self.high, self.periods = low, high, periods

    def result(self) -> dict:
        low, high = self.low.result(), self.high.result()
        return {k: max(0, round(low[k] + (high[k] - low[k]) * self.periods)) for k in low}


def submit_trace(recipe: Recipe, rank: int, pool):
    """Rank `rank`'s traced peak (a future): traced at the recipe's depth, or, where that costs
    more, at a shallow depth and one period deeper and extrapolated linearly (Extrapolated).
    The period is 1 block, or `selective_every` under selective AC (checkpointed by layer id):
    shallow stages keep their block count and first layer id modulo the period, so the same
    blocks are checkpointed. Each trace runs in its own worker process (trace_pool)."""
    dims = ParallelDims.from_config(recipe.mesh)
    counts = [len(ids) for ids in stage_layout_of(recipe, dims)]
    ac = recipe.activation_checkpoint
    period = ac.selective_every if ac.mode == "selective" else 1
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
        return pool.submit(trace_rank, recipe, rank)
    low_trace, high_trace = (
        pool.submit(trace_rank, _with_stage_blocks(recipe, dims, c), rank) for c in (low, high)
    )
    return Extrapolated(low_trace, high_trace, missing / period)  # `high` adds one period to each


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


def trace_rank(recipe: Recipe, rank: int) -> dict:
    """Rank `rank`'s peak memory by category, traced on fake tensors (see module doc). Run it
    in a fresh process (trace_pool): torch caches plans by mesh layout across traces."""
    with (
        simulated_rank(recipe, rank) as (dims, meshes, pmodel),
        FakeTensorMode(allow_non_fake_inputs=True),
        isolated_sharding_propagation(),
    ):
        for part in pmodel.parts:
            to_empty(part, "cpu")  # no weight init: values do not matter (and trunc_normal_ fails here)
            part.init_buffers(torch.device("cpu"))
            part.train()
        # for-loop: foreach AdamW's batched temporaries would be counted all at once under fake tensors
        optimizers = [
            build_optimizer(part.parameters(), recipe.optimizer, implementation="for-loop")
            for part in pmodel.parts
        ]
        actions, stages = _rank_actions(recipe, dims, meshes, pmodel, rank)
        _allocate_moments(optimizers)  # steady state: as on step 2 of a run
        offloaded = _sharded_states(pmodel.parts, optimizers)  # before a step leaves params unsharded
        tracker = make_tracker(pmodel.parts, optimizers)
        with (
            tracker,
            StepPolicy.of(dims, recipe.tp, recipe.fsdp).context("cpu"),
            quiet_embedding_view_warning(),
        ):
            _run_actions(recipe, dims, pmodel, actions)
            for stage in stages:
                stage.perform_reduce_grad(1)  # the schedule's final gradient reduction (FSDP)
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        peak = peak_categories(tracker)
        return off_the_device(peak, offloaded) if recipe.fsdp.cpu_offload else peak


def _sharded_states(parts: list, optimizers: list) -> dict[str, int]:
    """This rank's sharded parameters, their gradients (each its parameter's size) and optimizer
    state, in bytes: what FSDP's CPU offload keeps on the host."""

    def local_bytes(tensors) -> int:
        return sum(
            (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors
        )

    params = local_bytes(p for part in parts for p in part.parameters())
    moments = local_bytes(
        v
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)  # the moments and AdamW's step counters
    )
    return {"parameters": params, "gradients": params, "optimizer": moments}


def off_the_device(peak: dict[str, int], offloaded: dict[str, int]) -> dict:
    """The traced peak with the offloaded states moved off the device: each category loses
    what is on the host (at most what it held at the peak), `host` says how much that is, and
    `total` is the device's."""
    out = {c: max(0, peak[c] - offloaded.get(c, 0)) for c in CATEGORIES}
    return {**out, "total": sum(out.values()), "host": sum(offloaded.values())}


def _rank_actions(recipe: Recipe, dims, meshes, pmodel, rank: int) -> tuple[list[tuple[int, str, int]], list]:
    """(stage, 'F'|'B'|'I'|'W', microbatch) in the order this rank runs them, and the torch
    pipeline stages (for their final gradient reduction; none without pipelining)."""
    if not dims.pp_enabled:  # microbatches one after another; the second backward finds every grad allocated
        return [(0, kind, m) for m in range(min(recipe.train.grad_accum_steps, 2)) for kind in "FB"], []
    schedule = build_schedule(
        pmodel.parts, pmodel.stage_ids, meshes.pp, recipe.pp, torch.device("cpu"), lambda x, y: x
    )
    mine = pipeline_order(schedule)[dims.coordinate(rank)["pp"]]
    stages = getattr(schedule, "_stages", None) or [schedule._stage]  # torch keeps a list, or one
    return [a for a in map(parse_action, mine) if a is not None], stages


def _allocate_moments(optimizers: list[torch.optim.Optimizer]) -> None:
    """AdamW's state as its first step creates it (a step counter and two moments shaped like
    each parameter), so the traced step is a steady-state one. Made directly: running a step
    on zero gradients cost ~1.3 s per 8B trace under fake DTensors; a changed state layout
    fails the traced step loudly (AdamW reads these keys)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def _run_actions(recipe: Recipe, dims, pmodel, actions: list[tuple[int, str, int]]) -> None:
    """Forwards and backwards in the given order, each forward's output kept until its backward."""
    r, args = recipe, args_from_config(recipe.model)
    last_stage = dims.pp * r.pp.stages_per_rank - 1
    mb = r.train.micro_batch_size // (r.pp.microbatches if dims.pp_enabled else 1)
    sp = dims.tp_enabled and r.tp.sequence_parallel
    tokens = r.train.seq_len // dims.cp  # this rank's part of every sequence under cp
    boundary = (mb, tokens // dims.tp if sp else tokens, args.dim)  # what a stage sends
    act_dtype = DTYPES[r.fsdp.param_dtype] if fsdp_applies(dims, r.fsdp) else torch.float32
    parts = dict(zip(pmodel.stage_ids, pmodel.parts))
    live: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output awaiting its backward
    for stage, kind, m in actions:
        part = parts[stage]
        if kind == "F":
            x = (
                torch.randint(0, args.vocab_size, (mb, tokens))
                if stage == 0
                else torch.empty(boundary, dtype=act_dtype, requires_grad=True)
            )
            out = part(x)
            if stage == last_stage:
                out = cross_entropy_sum(out, torch.randint(0, args.vocab_size, (mb, tokens)))
            live[(stage, m)] = out
        elif kind in "BI":  # a zero-bubble input-gradient half counted as the whole backward
            if dims.pp_enabled and isinstance(part, FSDPModule):
                # as torch's PipelineStage runs FSDP: no reduce-scatter and no reshard until the
                # step's last backward, so unsharded params and grads live across microbatches
                part.set_is_last_backward(False)
                part.set_reshard_after_backward(False)
                part.set_requires_gradient_sync(False)
            out = live.pop((stage, m))
            out.backward(None if out.dim() == 0 else torch.empty_like(out))
            del out


def traced_estimate(recipe: Recipe, pool) -> dict:
    """The heaviest role's categories, with `rank` saying which global rank it is."""
    return heaviest(submit_roles(recipe, pool))


def submit_roles(recipe: Recipe, pool) -> list:
    """One trace per distinct role of the mesh, started on `pool` (trace_pool); `heaviest`
    collects them, so many recipes' traces can run at once."""
    return [
        (rank, submit_trace(recipe, rank, pool))
        for rank in ParallelDims.from_config(recipe.mesh).role_ranks()
    ]


def heaviest(results: list) -> dict:
    per_role = [dict(r.result(), rank=rank) for rank, r in results]
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
    recipe_path: str, overrides: list[str], world: int, all_meshes: bool, traced: bool = True
) -> list[dict]:
    """One row per mesh: the analytic figures, and (traced=True) the traced heaviest rank."""
    rows, pending, meshes = [], [], [None]
    if all_meshes:
        meshes = ParallelDims.all_of_world(world, experts_of(load_config(recipe_path, overrides)[0]))
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(trace_pool()) if traced else None
        for mesh in meshes:
            extra = mesh.overrides() if mesh else []
            try:
                recipe = load_recipe(recipe_path, [*overrides, *extra], world_size=world)
            except RecipeError as e:
                rows.append({"layout": mesh.label() if mesh else "recipe", "refused": str(e.problems[0])})
                continue
            plan = make_plan(recipe)
            row = {
                "layout": plan.dims.label(),
                "analytic": analytic_figures(plan),
            }
            rows.append(row)
            if traced:
                pending.append((row, submit_roles(recipe, pool)))
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
    columns = ["layout"]
    if traced:
        columns += ["peak", "rank", *SHORT.values()]
    offload = any(r.get("analytic", {}).get("host") for r in rows)
    columns += ["analytic states", "analytic activations", "analytic total"]
    columns += ["host (offloaded states)"] * offload + ["fits"]
    for c in columns:
        table.add_column(c, justify="left" if c == "layout" else "right")
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
    rows = estimate_rows(recipe_path, overrides, world, all_meshes, traced=not analytic)
    out = console if console.is_terminal else Console(width=160)
    out.print(estimate_table(rows, device_memory))
    for line in estimate_refusals(rows) + estimate_caveats(load_config(recipe_path, overrides)[0]):
        out.print(line, highlight=False, soft_wrap=True)


def estimate_caveats(recipe: Recipe) -> list[str]:
    """What the trace cannot see of this recipe, said under the table."""
    if recipe.activation_checkpoint.mode != "memory_budget":
        return []
    return [
        "activation_checkpoint.mode = memory_budget: traced eager (the compiler's partitioner, which "
        "recomputes within the budget, does not run on fake tensors): activations are an upper bound"
    ]
