"""Memory by category, from torch's own trackers, for a measured step and for an estimate.

torch's `MemTracker` watches every tensor storage created under it and labels it
(parameter, buffer, gradient, optimizer state, activation, temporary). It works on CPU
tensors and on fake tensors alike, so the same code measures a real step (train.py) and
traces one for `meshforge estimate` (simulate/estimate.py). We fold its labels into six categories
(`communication` is kept for FSDPMemTracker's labels, unused for now: see make_tracker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.tensor import DTensor

from meshforge.core.units import GiB

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "temporaries")

# torch's labels (MemTracker's _MemRefType and FSDPMemTracker's _FSDPRefType values) -> ours
_FOLD = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "All Gather": "communication",
    "Reduce Scatter": "communication",
    "Temp": "temporaries",
    "Other": "temporaries",
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


@contextlib.contextmanager
def tracked_step(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], eager: bool) -> Iterator:
    """Track memory by category over the block. torch.compile cannot run under a dispatch
    mode, so with eager=True (a compiled model) the block runs eagerly, as the estimator
    traces it: under compile the figures are the eager step's."""
    stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    tracker = make_tracker(parts, optimizers)
    with stance, tracker:
        yield tracker


# Ops that make no tensor, passed straight through: `tensor.device` on a fake tensor is half of a
# traced step's dispatches (autograd and checkpointing ask it), and FSDP's record_function markers.
_NO_TENSOR_OPS = frozenset(
    {
        torch.ops.prim.device.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)


class StepMemTracker(MemTracker):
    """MemTracker for a whole step: a top-level module may run forward again (the next
    microbatch) before the earlier ones ran backward. torch refuses that because its
    per-module statistics would mix microbatches; we read only the step's totals (kept
    by the dispatch mode, not these hooks), so the repeat is let through unrecorded."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "step"  # what the step is doing now (the caller sets it)
        # (the modules running, backward?) -> where in the phase: each place keeps its own peak
        self.locate: Callable[[str, set[str], bool], str] | None = None
        self.phase_peaks: dict[str, dict] = {}  # {phase[:place]: {device: snapshot at its peak}}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _NO_TENSOR_OPS or DTensor in types:
            return super().__torch_dispatch__(func, types, args, kwargs)
        # torch's path without its search of the output for tensors to track (there are none)
        out = func(*args, **(kwargs or {}))
        # torch < 2.13 (the GPU machines' 2.11) has no entry mode and records every op
        if active_fake_mode() is getattr(self, "_fake_mode_on_entry", active_fake_mode()):
            self._update_peak_stats(None)  # the place it runs in keeps its peak, as on torch's path
        return out

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            pass  # raised before any state changed; the module keeps its first stats

    def _update_peak_stats(self, peak_state) -> None:
        # Only the step's and the phases' peaks are read. torch also walks every module's statistics
        # on every op (ops x modules: 2/3 of an 8B trace's time), for per-module peaks nobody reads.
        for dev, snap in self._curr_mem_snap.items():
            total = snap[_TOTAL_KEY]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(snap)
            key = self.phase
            if self.locate is not None:
                key += ":" + self.locate(self.phase, self._mod_tracker.parents, self._mod_tracker.is_bw)
            phase = self.phase_peaks.setdefault(key, {})
            if phase.get(dev, {}).get(_TOTAL_KEY, 0) < total:
                phase[dev] = dict(snap)


def peak_categories(tracker) -> dict[str, int]:
    """The categories at the tracker's peak (the moment its total was highest)."""
    return fold(tracker.get_tracker_snapshot("peak"))


def phase_peak_categories(tracker: StepMemTracker) -> dict[str, dict[str, int]]:
    """The categories at each phase's own peak: where a step peaks can move to another phase as
    a model grows, so an estimate that extrapolates depth extrapolates every phase's peak."""
    return {phase: fold(snapshot) for phase, snapshot in tracker.phase_peaks.items()}


def in_gib(categories: dict[str, int]) -> dict[str, float]:
    """Categories in bytes -> `<category>_gib`, as a run records them (beside `memory/*_gib`)."""
    return {f"{k}_gib": v / GiB for k, v in categories.items()}
