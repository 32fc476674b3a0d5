"""A point's seeds in `compare`: runs named `<point>-seed<i>` (what `--seeds K` writes) are one
point; each point's final metric is given as mean and standard deviation over its seeds, and
against a baseline point as the difference of the means with Welch's confidence interval
(scipy.stats.ttest_ind, equal_var=False) and whether it is significant."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure  # the object API, as compare's plots: files only
from rich.console import Console
from rich.table import Table

from meshforge.experiments.compare import Run

_SEED = re.compile(r"^(?P<point>.+)-seed\d+$")


def point_of(run_name: str) -> str:
    """The point a run repeats: its name without `-seed<i>`."""
    m = _SEED.match(run_name)
    return m["point"] if m else run_name


def unfinished(runs: list[Run]) -> list[str]:
    """Runs that did not finish (failed, pruned, preempted, still running): their last value is
    an earlier step's, so the seeds' statistics leave them out."""
    return [r.name for r in runs if r.info.get("status") != "finished"]


def final_values(runs: list[Run], metric: str) -> dict[str, list[float]]:
    """Each point's finished runs' last logged `metric`, by point (runs that never logged it, or did
    not finish, left out)."""
    points: dict[str, list[float]] = {}
    for r in runs:
        if r.name in unfinished([r]):
            continue
        logged = [row[metric] for row in r.rows if metric in row]
        if logged:
            points.setdefault(point_of(r.name), []).append(float(logged[-1]))
    return points


@dataclass
class Difference:
    """One point against the baseline: mean(point) - mean(baseline), Welch's interval of it."""

    point: str
    diff: float
    low: float
    high: float
    pvalue: float
    significant: bool


def differences(points: dict[str, list[float]], baseline: str, confidence: float = 0.95) -> list[Difference]:
    """Every other point against `baseline` by Welch's t-test (each needs 2 seeds or more)."""
    from scipy import stats  # slow to import: only when seeds are compared

    base = points[baseline]
    out = []
    for name, values in points.items():
        if name == baseline or len(values) < 2 or len(base) < 2:
            continue
        test = stats.ttest_ind(values, base, equal_var=False)
        ci = test.confidence_interval(confidence)
        diff = sum(values) / len(values) - sum(base) / len(base)
        out.append(
            Difference(
                name, diff, float(ci.low), float(ci.high), float(test.pvalue), test.pvalue < 1 - confidence
            )
        )
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1; nan for one value)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    return mean, std


def seeds_table(
    points: dict[str, list[float]], metric: str, baseline: str | None, confidence: float = 0.95
) -> Table:
    """Each point's seeds, mean and std; with a baseline, each point's difference, its interval and
    verdict."""
    diffs = {d.point: d for d in differences(points, baseline, confidence)} if baseline else {}
    level = f"{confidence:.0%}"
    table = Table(title=f"final {metric} over seeds" + (f", against {baseline}" if baseline else ""))
    for col in ("point", "seeds", "mean", "std", "difference", f"{level} interval (Welch)", "p", "verdict"):
        table.add_column(col)
    for name, values in points.items():
        mean, std = mean_std(values)
        d = diffs.get(name)
        if d is not None:
            extra = [f"{d.diff:+.4g}", f"[{d.low:+.4g}, {d.high:+.4g}]", f"{d.pvalue:.3g}"]
            extra.append("[bold]significant[/]" if d.significant else "within noise")
        elif name == baseline:
            extra = ["", "", "", "baseline"]
        else:
            extra = ["", "", "", "needs 2+ seeds each" if baseline else ""]
        table.add_row(name, str(len(values)), f"{mean:.4f}", f"{std:.4f}" if len(values) > 1 else "", *extra)
    return table


def print_seeds(runs: list[Run], metrics: str, baseline: str | None, console: Console, folder: Path) -> bool:
    """When some point has several seeds: print the seeds table of the first of `metrics` (compare's
    --metrics) and draw each point's curve with its spread (`<metric>_by_point.png` in `folder`).
    True when `baseline` named a point (not a run), the differences then being against it."""
    metric = metrics.split(",")[0]
    points = final_values(runs, metric)
    if not any(len(v) > 1 for v in points.values()):
        return False
    is_point = baseline in points and all(r.name != baseline for r in runs)
    console.print(seeds_table(points, metric, baseline if is_point else None))
    if left_out := unfinished(runs):
        console.print(f"left out (did not finish): {', '.join(left_out)}", highlight=False)
    path = folder / f"{metric.replace('/', '_')}_by_point.png"
    plot_spread(runs, metric).savefig(path, dpi=100)
    console.print(f"plot over seeds: {path}", highlight=False)
    return is_point


def plot_spread(runs: list[Run], metric: str) -> Figure:
    """Each point's mean `metric` over its seeds against step, shaded one standard deviation either
    side (the steps every seed logged)."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    by_point: dict[str, list[Run]] = {}
    for r in runs:
        by_point.setdefault(point_of(r.name), []).append(r)
    for i, (name, group) in enumerate(by_point.items()):
        curves = [{row["step"]: row[metric] for row in r.rows if metric in row} for r in group]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if not steps:
            continue
        stats = [mean_std([c[s] for c in curves]) for s in steps]
        means = [m for m, _ in stats]
        ax.plot(steps, means, color=f"C{i % 10}", label=f"{name} ({len(group)} seeds)")
        if len(group) > 1:
            ax.fill_between(
                steps, [m - sd for m, sd in stats], [m + sd for m, sd in stats], color=f"C{i % 10}", alpha=0.2
            )
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric}: mean over seeds, ±1 std shaded")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig
