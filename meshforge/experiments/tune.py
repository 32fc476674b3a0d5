"""`meshforge tune`: the fastest layout that fits, predicted before launching and then proved.

Every layout x policy point of a recipe (the sweep's grid: sweep.py) is validated and traced
once on a pool of simulated ranks; the trace gives its peak memory (estimate.py) and its work
(op_costs.py), which simulate/step_time.py prices with a hardware profile (hardware.py). Points
that do not fit are dropped, the rest ranked by predicted throughput (tokens/s: a layout can change
the global batch, micro batch x accumulation x data-parallel degree, so its step time alone does
not rank it; with a fixed `train.global_batch_size` the order is the step time's). Then the top k, and the
recipe's own point, run for a few steps as sweep points do, and the table shows predicted next
to measured. `tune.jsonl` keeps every row, `tune-best.toml` is the recipe with the winner's
overrides, and W&B gets the table (offline without a key). `--plan` stops after the prediction.
The confirmations run where the sweep's would (`sweep.launcher`): here, or as Slurm jobs.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshforge.configs import RecipeError, RecipeSource
from meshforge.configs.loader import recipe_to_toml
from meshforge.core.errors import NothingProduced
from meshforge.core.tables import add_name_column, wide
from meshforge.core.topology import ParallelDims
from meshforge.core.units import GiB
from meshforge.experiments.grid import grid_points, point_label
from meshforge.experiments.point_process import run_point
from meshforge.experiments.slurm import check_commands, run_on_slurm
from meshforge.experiments.sweep import (
    choose_launcher,
    log_wandb_table,
    mesh_for,
    plan_point,
    point_command,
)
from meshforge.experiments.sweep_record import MEASURED, measure
from meshforge.experiments.tune_caveats import batch_caveat, checkpoints, refuse_untraced, untraced_caveats
from meshforge.models import args_from_config
from meshforge.recipe import experts_of, load_recipe
from meshforge.recipe.inert import unread_on_mesh
from meshforge.run.observe.flops import flops_per_token
from meshforge.run.rank.plan import make_plan
from meshforge.simulate.estimate import heaviest, role_works, trace_pool
from meshforge.simulate.hardware import Profile
from meshforge.simulate.step_time import predict_step


def tune(
    recipe_path: str,
    overrides: list[str],
    world: int,
    profile: Profile,
    axes: dict[str, list[str]],
    top_k: int,
    plan_only: bool,
    tune_dir: Path | None,
    console: Console,
) -> Path:
    """Predict, rank and (unless `plan_only`) confirm every point; returns the tune folder."""
    started = time.monotonic()
    source = RecipeSource.read(recipe_path)  # read once: every point is it and its overrides
    recipe_path = str(source.path.resolve())  # the points' commands run it from elsewhere
    base = load_recipe(source, [*overrides, *mesh_for(world)], world_size=world)
    sw = base.sweep
    axes = {**sw.axes, **axes}
    refuse_untraced(axes)
    stem = Path(recipe_path).stem
    tune_dir = (tune_dir or Path(base.output_dir) / f"tune-{stem}-w{world}").resolve()
    group = base.logging.wandb_group or f"{stem}/{tune_dir.name}"
    experts = experts_of(base)
    points = grid_points(source, overrides, world, axes, sw.only, experts)
    own = _own_label(source, overrides, axes)
    console.print(
        f"tune {tune_dir}: {len(points)} points over {world} ranks, profile {profile.name}", highlight=False
    )
    # a step predicted short by what the profile never measured
    if missing := profile.unpriced(world, checkpoints(base, points)):
        fix = (
            "meshforge tune --calibrate measures them on the machine that runs the tune's layouts"
            if profile.shared_cores
            else "`--calibrate --world 1 --profile-out gpu.toml` on a GPU node measures the host's; "
            "copy their values into a copy of this profile"
        )
        console.print(f"profile {profile.name} does not price {' or '.join(missing)}: {fix}", highlight=False)
    limit = sw.device_memory_gib or profile.device_memory_gib or None
    launcher = "plan" if plan_only else choose_launcher(sw.launcher, world, base.train.device)
    if launcher == "slurm":
        check_commands()  # before the plan's minutes, not after
    with trace_pool() as pool:
        planned = [
            plan_point(i, pt, source, overrides, world, sw, group, tune_dir, pool, work=True)
            for i, pt in enumerate(points, 1)
        ]
        rows = [_predict(row, recipe, traces, profile, limit) for _, _, row, recipe, traces in planned]
    ranked = rank_predicted(rows)
    if ranked:  # else no table: the refusals, and tune's error
        wide(console).print(predicted_table(ranked, profile, limit))
    for line in [batch_caveat(ranked), *untraced_caveats(base, points, profile.checkpoint_overhead_s > 0)]:
        if line:
            console.print(line, highlight=False)
    for r in rows:
        if r["status"] in ("refused", "skipped"):
            console.print(f"  {r['label']}: {r['status']}: {r['error']}", highlight=False)
    others = Counter(r["status"] for r in rows if r["status"] != "planned")  # refused, skipped, failed
    console.print(
        f"predicted {len(ranked)} of {len(rows)} points in {time.monotonic() - started:.0f} s"
        + (f" ({', '.join(f'{n} {status}' for status, n in others.items())})" if others else ""),
        highlight=False,
    )
    if not ranked:
        raise NothingProduced(
            f"nothing predicted: none of the {len(rows)} points is valid and fits (each listed above)"
        )
    if plan_only:
        return tune_dir
    tune_dir.mkdir(parents=True, exist_ok=True)
    record = tune_dir / "tune.jsonl"
    chosen = ranked[:top_k] + [r for r in ranked[top_k:] if r["label"] == own]
    if launcher == "slurm":  # the sweep's jobs: one per point, max_concurrent at once, followed to the end
        points = {row["label"]: (pt, recipe) for _, pt, row, recipe, _ in planned}
        todo = []
        for i, r in enumerate(chosen, 1):  # numbered as confirmations: [1/4] ...
            pt, recipe = points[r["label"]]
            todo.append((i, pt, r, recipe, point_command(recipe_path, r)))
        collect = (
            f"their runs land in {tune_dir}/<point>; `meshforge compare {tune_dir}` reads them when done"
        )
        run_on_slurm(todo, {}, world, sw, tune_dir, tune_dir / "confirm.jsonl", console, len(todo), collect)
        for r in chosen:
            if r["status"] == "finished":
                r["measured"] = {k: r.pop(k) for k in MEASURED}
    for r in chosen if launcher != "slurm" else []:
        console.print(f"confirming {r['label']} ({sw.steps} steps) ...", highlight=False)
        status, error = run_point(point_command(recipe_path, r), sw.timeout_s, tune_dir / f"{r['label']}.log")
        r.update(status=status, error=error)
        if status == "finished":
            r.update(measured=measure(tune_dir / r["label"]))
    with open(record, "w") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if k != "traced"}) + "\n")
    wide(console).print(confirmed_table(chosen, own))
    _report_best(source, overrides, world, chosen, own, tune_dir, console)
    flat = [{**r, **_flat(r)} for r in chosen]
    log_wandb_table(base, group, "tune_summary", flat, list(_flat(chosen[0])) if chosen else [], tune_dir)
    return tune_dir


def _own_label(source: RecipeSource, overrides: list[str], axes: dict[str, list[str]]) -> str | None:
    """The label the recipe's own layout and policy values have in the grid (None: its mesh needs
    a world size, so it is no point of the grid)."""
    try:
        cfg = load_recipe(source, overrides)
    except RecipeError:
        return None
    mesh = ParallelDims.from_config(cfg.mesh).degrees
    policy = {}
    for key in (k for k in axes if not unread_on_mesh(k, mesh)):  # as sweep_points crosses them
        section, _, field = key.rpartition(".")
        value = cfg
        for part in section.split("."):
            value = getattr(value, part)
        v = getattr(value, field)
        policy[key] = str(v).lower() if isinstance(v, bool) else str(v)  # as an axis spells it
    return point_label(mesh, policy)


def _predict(row: dict, recipe, traces, profile: Profile, limit: float | None) -> dict:
    """The point's traced peak memory and predicted step; `skipped` where it does not fit."""
    if traces is None:
        return row
    dims = ParallelDims.from_config(recipe.mesh)
    peak = heaviest(traces)
    works = role_works(traces, dims)
    p = predict_step(works, dims, recipe.train.grad_accum_steps, profile)
    tokens = recipe.train.global_batch_size * recipe.train.seq_len
    per_device = tokens / p.step_s / dims.world_size if p.step_s > 0 else float("inf")
    # MFU against the profile's peak for fsdp.param_dtype (a GPU's datasheet, a CPU's measured
    # rate): the trainer's rule
    peak_flops = profile.peak_flops.get(recipe.fsdp.param_dtype)
    flops = flops_per_token(args_from_config(recipe.model), recipe.train.seq_len, make_plan(recipe).n_params)
    mfu = flops * per_device / peak_flops if peak_flops else None
    row.update(
        status="planned",
        estimate_gib=round(peak["total"] / GiB, 3),
        predicted={
            **p.as_dict(),
            "tokens_per_step": tokens,
            "tokens_per_sec_per_device": round(per_device, 1),
            "mfu": mfu,
        },
    )
    if limit is not None and peak["total"] > limit * GiB:
        row.update(status="skipped", error=f"estimate {row['estimate_gib']} GiB > {limit} GiB")
    return row


def rank_predicted(rows: list[dict]) -> list[dict]:
    """Points that fit, highest predicted tokens/s first (every point runs on the same world)."""

    def rate(r: dict) -> tuple[float, float]:
        p = r["predicted"]
        return (-p["tokens_per_step"] / p["step_s"] if p["step_s"] > 0 else -float("inf"), p["step_s"])

    return sorted((r for r in rows if r["status"] == "planned"), key=rate)


def _table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    """Numbers right-aligned beside the point's name, which is never cut short."""
    table = Table(title=title)
    for i, col in enumerate(columns):
        if col == "point":
            add_name_column(table, col, (r[i] for r in rows))
        else:
            table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r)
    return table


def predicted_table(rows: list[dict], profile: Profile, limit: float | None) -> Table:
    fits = f"fits in {limit:.1f} GiB" if limit else "fit not judged (no device memory)"
    host = any(r["predicted"].get("host_s") for r in rows)  # a GPU's: the host runs ahead of it
    columns = ["#", "point", "step s", "tokens/s per device", "MFU", "peak GiB", "bubble", "comm share"]
    cells = []
    for i, r in enumerate(rows, 1):
        p = r["predicted"]
        share = f"{p.get('host_s', 0.0) / p['step_s']:.1%}" if host and p["step_s"] > 0 else ""
        cells.append(
            [
                str(i),
                r["label"],
                f"{p['step_s']:.4g}",
                f"{p['tokens_per_sec_per_device']:,.0f}",
                f"{p['mfu']:.1%}" if p.get("mfu") is not None else "",
                f"{r['estimate_gib']:.2f}",
                f"{p['bubble']:.1%}",
                f"{p['exposed_comm_s'] / p['step_s']:.1%}" if p["step_s"] > 0 else "",
                *[share] * host,
            ]
        )
    title = f"tune: predicted on {profile.name}, highest tokens/s first ({fits})"
    return _table(title, columns + ["host share"] * host, cells)


def _flat(r: dict) -> dict:
    m = r.get("measured") or {}
    return {
        "predicted_step_s": r["predicted"]["step_s"],
        "predicted_tokens_per_sec_per_device": r["predicted"]["tokens_per_sec_per_device"],
        "measured_step_s": m.get("step_time"),
        "error": m["step_time"] and r["predicted"]["step_s"] / m["step_time"] - 1
        if m.get("step_time")
        else None,
        "tokens_per_sec": m.get("tokens_per_sec"),
    }


def confirmed_table(rows: list[dict], own: str) -> Table:
    columns = ["point", "predicted step s", "measured step s", "error", "measured tokens/s", "status"]
    cells = []
    for r in rows:
        f = _flat(r)
        cells.append(
            [
                r["label"] + (" *" if r["label"] == own else ""),
                f"{f['predicted_step_s']:.4f}",
                f"{f['measured_step_s']:.4f}" if f["measured_step_s"] else "",
                f"{f['error']:+.1%}" if f["error"] is not None else "",
                f"{f['tokens_per_sec']:,.0f}" if f["tokens_per_sec"] else "",
                r["status"] if r["status"] == "finished" else f"[red]{r['status']}[/]",
            ]
        )
    table = _table("tune: predicted vs measured (steady steps)", columns, cells)
    table.caption = "* the recipe's own layout" if any(r["label"] == own for r in rows) else None
    return table


def _report_best(source: RecipeSource, overrides, world, chosen, own, tune_dir, console) -> None:
    """The fastest measured point (most tokens/s), its speedup over the recipe's own point, and
    the recipe with its overrides written out."""
    finished = [r for r in chosen if r["status"] == "finished"]
    if not finished:
        console.print("no confirmed point finished: nothing to recommend", highlight=False)
        return
    best = max(finished, key=lambda r: r["measured"]["tokens_per_sec"])
    line = f"fastest measured: [bold]{best['label']}[/] ({best['measured']['tokens_per_sec']:,.0f} tokens/s)"
    mine = next((r for r in finished if r["label"] == own), None)
    if mine and mine is not best and mine["measured"]["tokens_per_sec"]:
        speedup = best["measured"]["tokens_per_sec"] / mine["measured"]["tokens_per_sec"]
        line += f", {speedup:.2f}x the tokens/s of the recipe's own ({own})"
    out = tune_dir / "tune-best.toml"
    recipe = load_recipe(source, [*overrides, *best["overrides"]], world_size=world)
    out.write_text(
        f"# meshforge tune: {best['label']}, from {source.path.resolve()}\n" + recipe_to_toml(recipe)
    )
    console.print(f"{line}; recipe: {out}", highlight=False)
