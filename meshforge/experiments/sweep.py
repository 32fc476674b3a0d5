"""Sweep one recipe over every valid mesh shape (and policy axes) to find the fastest layout.

W&B's sweep controller needs a server and cannot express dp_replicate*dp_shard*cp*tp*pp ==
world size, so the grid is built here. First the plan: every point is validated (refusals
are recorded with the reason) and its traced estimate started, all at once on a pool of
simulated ranks; points that do not fit the device memory are skipped (`--plan` stops
here, launching nothing). Then each point runs as its own `run_recipe` with a timeout:
here, one after another once every trace is done, or as a Slurm job (slurm.py), several at
once, each submitted as soon as its point is judged. A point that fails,
OOMs, hangs or is cancelled is recorded and the sweep goes on. `sweep.jsonl`
(sweep_record.py) is appended as things happen, so rerunning the same sweep keeps the
finished points and asks the scheduler again about jobs still queued or running.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshforge.configs import Recipe, RecipeError, RecipeSource
from meshforge.configs.schema import SweepConfig
from meshforge.core.errors import NothingProduced
from meshforge.core.logs import log_level_name
from meshforge.core.tables import add_name_column, wide
from meshforge.core.topology import LAYOUT_DIMS, ParallelDims
from meshforge.core.units import GiB
from meshforge.experiments.grid import grid_points, mesh_shapes
from meshforge.experiments.point_process import run_point
from meshforge.experiments.slurm import check_commands, run_on_slurm
from meshforge.experiments.sweep_record import append_row, measure, read_rows
from meshforge.recipe import experts_of, load_recipe
from meshforge.run.observe.loggers import wandb_settings
from meshforge.run.rank.plan import make_plan
from meshforge.simulate.estimate import (
    analytic_figures,
    estimate_refusals,
    estimate_table,
    heaviest,
    submit_roles,
    trace_pool,
)


def run_sweep(
    recipe_path: str,
    overrides: list[str],
    world: int,
    axes: dict[str, list[str]] | None = None,
    sweep_dir: Path | None = None,
    console: Console | None = None,
    plan_only: bool = False,
) -> Path:
    """Sweep `recipe_path` over every mesh of `world` ranks (x the recipe's and `axes`'
    policy values); returns the sweep folder. `plan_only`: print each layout's traced
    estimate and whether it fits, launch nothing, write nothing."""
    console = console or Console(soft_wrap=True)
    source = RecipeSource.read(recipe_path)  # read once: every point is it and its overrides
    recipe_path = str(source.path.resolve())  # Slurm jobs run it from elsewhere
    base = load_recipe(source, [*overrides, *mesh_for(world)], world_size=world)
    sw = base.sweep
    sw.axes = {**sw.axes, **(axes or {})}
    stem = Path(recipe_path).stem
    sweep_dir = (sweep_dir or Path(base.output_dir) / f"sweep-{stem}-w{world}").resolve()
    record = sweep_dir / "sweep.jsonl"
    done = {} if plan_only else read_rows(record)
    group = base.logging.wandb_group or f"{stem}/{sweep_dir.name}"
    experts = experts_of(base)
    points = grid_points(source, overrides, world, sw.axes, sw.only, experts)
    meshes = len(mesh_shapes(world, experts))
    launcher = "plan" if plan_only else choose_launcher(sw.launcher, world, base.train.device)
    layouts = len({ParallelDims(**p.mesh).label() for p in points})
    crossed = f" x {', '.join(sw.axes)} where read" if sw.axes else ""
    console.print(
        f"sweep {sweep_dir}: {len(points)} points over {world} ranks "
        f"({layouts} of {meshes} layouts{crossed}), launcher: {launcher}",
        highlight=False,
    )
    if launcher == "slurm":
        check_commands()
    if not plan_only:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    n = len(points)
    active = {}
    started = time.monotonic()
    with trace_pool() as pool:
        planned = []
        for i, pt in enumerate(points, 1):
            old = done.get(pt.label, {})
            if old.get("status") in ("finished", "refused", "skipped"):
                console.print(f"[{i}/{n}] {pt.label}: {old['status']} earlier, kept")
            elif old.get("status") in ("queued", "running") and old.get("job_id"):
                active[old["job_id"]] = (i, old)  # submitted by an earlier run: ask the scheduler again
            else:
                planned.append(plan_point(i, pt, source, overrides, world, sw, group, sweep_dir, pool))
        if plan_only:
            for _, _, row, recipe, traces in planned:
                if traces is not None:
                    _judge_fit(row, recipe, heaviest(traces), sw.device_memory_gib)
            _print_plan([p[2] for p in planned], sw.device_memory_gib, console)
            if all(p[2]["status"] == "refused" for p in planned):
                raise NothingProduced(f"nothing planned: all {n} points were refused (each listed above)")
            console.print(
                f"planned {n} points in {time.monotonic() - started:.0f} s; nothing launched", highlight=False
            )
            return sweep_dir
        todo = _judged(planned, recipe_path, sw, record, console, n)
        if launcher == "slurm":  # each job submitted as soon as its point is judged: the rest trace meanwhile
            run_on_slurm(todo, active, world, sw, sweep_dir, record, console, n)
        else:
            todo = list(todo)  # every trace done first: a local point's timing must not share its cores
    if launcher != "slurm":
        for i, pt, row, _, command in todo:
            start = time.monotonic()
            status, error = run_point(command, sw.timeout_s, sweep_dir / f"{pt.label}.log")
            row.update(status=status, error=error, wall_s=round(time.monotonic() - start, 1))
            if status == "finished":
                row.update(measure(sweep_dir / pt.label))
            append_row(record, row, console, i, n)
    _report(base, group, sweep_dir, record, console)
    return sweep_dir


def _judged(
    planned: list, recipe_path: str, sw: SweepConfig, record: Path, console: Console, n: int
) -> Iterator:
    """The planned points that run, in order, as (i, point, row, recipe, command), each judged when
    its traces are done; a refused or skipped one is recorded on the way, and one whose trace
    failed is recorded failed (jobs may be queued already: the sweep goes on, a rerun retries it)."""
    for i, pt, row, recipe, traces in planned:
        if traces is not None:
            try:
                traced = heaviest(traces)
            except Exception as e:  # the trace's own error, from its worker
                row.update(status="failed", error=f"traced estimate failed: {type(e).__name__}: {e}")
            else:
                _judge_fit(row, recipe, traced, sw.device_memory_gib)
        if row["status"] in ("refused", "skipped", "failed"):
            append_row(record, row, console, i, n)
        else:
            yield i, pt, row, recipe, point_command(recipe_path, row)


def plan_point(i, pt, source, overrides, world, sw, group, sweep_dir, pool, work: bool = False) -> tuple:
    """Validate one point and start its traced estimate (with its work for `tune`); (i, point,
    row, recipe, traces)."""
    row = {"label": pt.label, "mesh": pt.mesh, "policy": pt.policy, "overrides": pt.overrides()}
    row["run_overrides"] = [
        *overrides,
        *pt.overrides(),
        f"train.steps={sw.steps}",
        f"output_dir={sweep_dir}",
        f"run_name={pt.label}",
        f"logging.wandb_group={group}",
        f"logging.wandb_tags=[sweep,{pt.label}]",
        "logging.wandb_job_type=sweep-point",
        "logging.progress=false",
    ]
    try:
        recipe = load_recipe(source, row["run_overrides"], world_size=world)
    except RecipeError as e:
        row.update(status="refused", error="; ".join(str(p) for p in e.problems))
        return i, pt, row, None, None
    return i, pt, row, recipe, submit_roles(recipe, pool, work)


def _judge_fit(row: dict, recipe: Recipe, traced: dict, device_memory_gib: float | None) -> None:
    """The traced estimate (heaviest rank, fake tensors) decides; the analytic one is kept beside it."""
    estimate, plan = traced["total"], make_plan(recipe)
    row["estimate_gib"], row["estimate_bytes"] = round(estimate / GiB, 3), estimate
    row["analytic_gib"] = round(plan.bytes_per_rank / GiB, 3)
    row["traced"] = traced
    row["analytic"] = analytic_figures(plan)
    row["status"] = "planned"
    if device_memory_gib is not None and estimate > device_memory_gib * GiB:
        row.update(status="skipped", error=f"estimate {row['estimate_gib']} GiB > {device_memory_gib} GiB")


def _print_plan(rows: list[dict], device_memory_gib: float | None, console: Console) -> None:
    """The plan as `meshforge estimate` prints it: every layout's traced peak, and its fit."""
    table_rows = [
        {"layout": r["label"], "refused": r["error"]}
        if r["status"] == "refused"
        else {
            "layout": r["label"],
            "traced": r["traced"],
            "analytic": r["analytic"],
            "total": r["estimate_bytes"],
        }
        for r in rows
    ]
    table_rows.sort(key=lambda r: r.get("total", float("inf")))
    memory = device_memory_gib * GiB if device_memory_gib is not None else None
    out = wide(console)
    estimated = any("refused" not in r for r in table_rows)
    if estimated:  # else no table: the refusals, and the sweep's error
        out.print(estimate_table(table_rows, memory))
    for line in estimate_refusals(table_rows):
        out.print(line, highlight=False, soft_wrap=True)
    if memory is None and estimated:
        out.print("fit not judged: set sweep.device_memory_gib (the GPU's memory in GiB)", highlight=False)


def point_command(recipe_path: str, row: dict) -> list[str]:
    # the sweep's log level, said on the command line: it holds for local points and Slurm jobs alike
    return [
        sys.executable,
        "-m",
        "meshforge.cli",
        recipe_path,
        *row["run_overrides"],
        "--log-level",
        log_level_name(),
    ]


def choose_launcher(launcher: str, world: int, device: str) -> str:
    """`auto`: Slurm when the world needs more GPUs than this machine has; CPU ranks
    (gloo processes) always run here."""
    if launcher != "auto":
        return launcher
    import torch

    gpus = torch.cuda.device_count() if device in ("auto", "cuda") and torch.cuda.is_available() else 0
    return "slurm" if gpus and world > gpus else "local"


def _report(base: Recipe, group: str, sweep_dir: Path, record: Path, console: Console) -> None:
    rows = list(read_rows(record).values())
    wide(console).print(summary_table(rows))
    for r in rows:
        if r["status"] != "finished":
            console.print(f"  {r['label']}: {r['status']}: {r.get('error', '')}", highlight=False)
    best = rank_rows(rows)
    if best:
        console.print(
            f"fastest layout that fits: [bold]{best[0]['label']}[/] "
            f"({best[0]['tokens_per_sec']:,.0f} tokens/s); reproduce with: " + " ".join(best[0]["overrides"]),
            highlight=False,
        )
    _log_wandb_table(base, group, rows, sweep_dir)


def mesh_for(world: int) -> list[str]:
    # the base recipe is validated on a 1-D mesh of `world`; each point sets its own
    return ParallelDims(dp_shard=world).overrides()


def rank_rows(rows: list[dict]) -> list[dict]:
    """Finished points, fastest first."""
    return sorted((r for r in rows if r["status"] == "finished"), key=lambda r: -r["tokens_per_sec"])


def summary_table(rows: list[dict]) -> Table:
    table = Table(title="sweep: fastest first")
    ranked = rank_rows(rows)
    others = [r for r in rows if r["status"] != "finished"]
    table.add_column("#")
    add_name_column(table, "layout", (r["label"] for r in rows))
    for col in ("status", "tokens/s", "step s", "peak mem max/min GiB", "estimate GiB", "final loss"):
        table.add_column(col)
    for i, r in enumerate(ranked + others, 1):
        fin = r["status"] == "finished"
        mem = (
            f"{r['peak_gib_max']:.2f}/{r['peak_gib_min']:.2f}"
            if fin and r.get("peak_gib_max") is not None
            else ""
        )
        table.add_row(
            str(i) if fin else "-",
            r["label"],
            r["status"],
            f"{r['tokens_per_sec']:,.0f}" if fin else "",
            f"{r['step_time']:.3f}" if fin else "",
            mem,
            str(r.get("estimate_gib", "")),
            f"{r['final_loss']:.4f}" if fin else "",
        )
    return table


def _log_wandb_table(base: Recipe, group: str, rows: list[dict], sweep_dir: Path) -> None:
    """The sweep summary as a W&B Table in the sweep's group, job_type sweep-summary."""
    columns = ["tokens_per_sec", "step_time", "final_loss"]
    log_wandb_table(base, group, "sweep_summary", rows, columns, sweep_dir)


def log_wandb_table(
    base: Recipe, group: str, key: str, rows: list[dict], columns: list[str], folder: Path
) -> None:
    """Rows of points (label, status, mesh, then `columns`) as a W&B Table under `key`, in a run
    of the group named and typed after it (sweep_summary: job_type sweep-summary), offline
    without a key, in `folder`."""
    if not base.logging.wandb:
        return
    name = key.replace("_", "-")
    settings = {**wandb_settings(base.logging), "group": group, "job_type": name}
    if settings["mode"] == "disabled":
        return
    import wandb  # slow to import: only when a table is logged

    table = wandb.Table(columns=["label", "status", *LAYOUT_DIMS, *columns])
    for r in rows:
        mesh = [ParallelDims.from_degrees(r["mesh"]).degrees[k] for k in LAYOUT_DIMS]
        table.add_data(r["label"], r["status"], *mesh, *[r.get(c) for c in columns])
    run = wandb.init(
        name=name,
        dir=str(folder),
        settings=wandb.Settings(init_timeout=60, silent=True),
        **settings,
    )
    run.log({key: table})
    run.finish()
