"""Memory by category, from torch's own trackers, for a measured step and for an estimate.

torch's `MemTracker` watches every tensor storage created under it and labels it
(parameter, buffer, gradient, optimizer state, activation, temporary). It works on CPU
tensors and on fake tensors alike, so the same code measures a real step (train.py) and
traces one for `meshforge estimate` (estimate.py). We fold its labels into six categories
(`communication` is kept for FSDPMemTracker's labels, unused for now: see make_tracker).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "temporaries")

# torch's labels (MemTracker's _MemRefType and FSDPMemTracker's _FSDPRefType values) -> ours
_FOLD = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "All Gather": "communication", "Reduce Scatter": "communication",
    "Temp": "temporaries", "Other": "temporaries",
}


def fold(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {label: bytes, 'Total': bytes}}) -> our categories + total."""
    out = dict.fromkeys(CATEGORIES, 0)
    for per_label in snapshot.values():
        for label, nbytes in per_label.items():
            if label in _FOLD:
                out[_FOLD[label]] += nbytes
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def make_tracker(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
    """A MemTracker over every model part and optimizer that allows a module to run forward
    more than once per step (microbatches, pipeline schedules).

    Not FSDPMemTracker, though it would tell FSDP's all-gather and reduce-scatter buffers
    apart: on torch 2.13 it leaves its forward hooks installed after it exits when one FSDP
    group holds several modules (our [norm, output] group), and the next step then fails.
    So FSDP buffers count as activations/temporaries and `communication` stays 0 for now.
    """
    tracker = StepMemTracker()
    tracker.track_external(*parts, *optimizers)
    return tracker


class StepMemTracker(MemTracker):
    """MemTracker for a whole step: a top-level module may run forward again (the next
    microbatch) before the earlier ones ran backward. torch refuses that because its
    per-module statistics would mix microbatches; we read only the step's totals (kept
    by the dispatch mode, not these hooks), so the repeat is let through unrecorded."""

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            pass  # raised before any state changed; the module keeps its first stats


def peak_categories(tracker) -> dict[str, int]:
    """The categories at the tracker's peak (the moment its total was highest)."""
    return fold(tracker.get_tracker_snapshot("peak"))


def breakdown_figure(per_rank: list[dict[str, float]], title: str):
    """A stacked bar per rank: the categories at that rank's peak, in MiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(per_rank) + 2), 4))
    bottom = [0.0] * len(per_rank)
    for cat in CATEGORIES:
        values = [r.get(cat, 0) / 2**20 for r in per_rank]
        ax.bar(range(len(per_rank)), values, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(per_rank)), [f"rank {i}" for i in range(len(per_rank))], rotation=45 if len(per_rank) > 8 else 0)
    ax.set_ylabel("MiB at the step's peak")
    ax.set_title(title)
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def save_breakdown(per_rank: list[dict[str, float]], path: Path, title: str):
    fig = breakdown_figure(per_rank, title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig
