"""The pictures a run draws beside its records (and logs to TensorBoard and W&B): the
pipeline schedule per rank, and memory by category per rank."""

from __future__ import annotations

from pathlib import Path

from meshforge.parallelisms.pp_actions import action_kind, bubble_fraction, pipeline_order
from meshforge.run.observe.memtrace import CATEGORIES

COMPUTE_COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#DD8452"}


def timeline(order: dict[int, list[str | None]], title: str):
    """A Gantt-style figure of a pipeline order: one row per rank, one cell per time step."""
    from matplotlib.figure import Figure  # here: a second of import no run pays until it draws
    from matplotlib.patches import Patch

    span = max(i + 1 for actions in order.values() for i, a in enumerate(actions) if action_kind(a))
    fig = Figure(figsize=(max(6, span * 0.35), 0.6 * len(order) + 1.5))
    ax = fig.subplots()
    for rank, actions in order.items():
        for t, a in enumerate(actions[:span]):
            kind = action_kind(a)
            if kind is None:
                continue
            ax.barh(rank, 1, left=t, color=COMPUTE_COLORS[kind], edgecolor="white")
            ax.text(t + 0.5, rank, a, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(list(order), [f"rank {r}" for r in order])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time step")
    ax.set_title(f"{title}: bubble {bubble_fraction(order):.1%}")
    labels = {"F": "F forward", "B": "B / I backward (input)", "W": "W backward (weights)"}
    ax.legend(
        handles=[Patch(color=COMPUTE_COLORS[k], label=text) for k, text in labels.items()],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize="x-small",
    )
    fig.tight_layout()
    return fig


def save_pipeline(schedule, title: str, path: Path) -> tuple:
    """Draw what a torch pipeline schedule runs, per rank, to `path`; the figure and the
    schedule's bubble fraction."""
    order = pipeline_order(schedule)
    fig = timeline(order, title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig, bubble_fraction(order)


def breakdown_figure(per_rank: list[dict[str, float]], title: str):
    """A stacked bar per rank: the categories at that rank's peak (recorded in GiB), drawn in MiB."""
    from matplotlib.figure import Figure  # the object API: files only, no pyplot backend chosen

    fig = Figure(figsize=(max(5, 0.7 * len(per_rank) + 2), 4))
    ax = fig.subplots()
    bottom = [0.0] * len(per_rank)
    for cat in CATEGORIES:
        values = [r.get(f"{cat}_gib", 0) * 1024 for r in per_rank]
        ax.bar(range(len(per_rank)), values, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(
        range(len(per_rank)),
        [f"rank {i}" for i in range(len(per_rank))],
        rotation=45 if len(per_rank) > 8 else 0,
    )
    ax.set_ylabel("MiB at the step's peak")
    ax.set_title(title)
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def save_breakdown(per_rank: list[dict[str, float]], path: Path, title: str):
    fig = breakdown_figure(per_rank, title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig
