"""The profiler: `[profile]` steps under torch.profiler, a trace per rank (TensorBoard's profiler
plugin and Perfetto open it), a CUDA memory snapshot when asked, and each profiled step's time split
into what it was spent on.

The split is read from the trace, as intervals on one timeline: the host thread that runs the step
on CPU, the device's kernels on CUDA (where the host only enqueues them). Communication is the union
of collective intervals (gloo/NCCL ops, c10d and functional collectives) that no compute interval
covers. On CUDA the compute intervals are the kernels. On CPU they are the step thread's operators
(`aten::` and compiled graphs, less the collective waits a DTensor op holds). A gloo op's interval
is its work's lifetime, and an asynchronous one (a pipeline's send, FSDP's all-gather) runs while
the thread computes, so it counts only while it is in flight and the thread is outside its
operators: waiting, or in Python and hooks, which read as communication while a collective is in
flight (e.g. a pp 2 GPipe step's sends spanned 300 of its 740 ms, and rank 0 read 342 ms of
send/receive where it waited 226 outside operators). Pipeline send/receive, the wait for the
neighbour stage (so the bubble with it), is its own part; data and optimizer are the trainer's named
regions (`DATA`, `OPTIMIZER`); compute is the rest of the step's wall time (forward, backward, host
work).
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

DATA, OPTIMIZER = "meshforge/data", "meshforge/optimizer"  # the trainer's record_function regions
PARTS = ("compute_s", "communication_s", "pipeline_p2p_s", "data_s", "optimizer_s")
_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
# record_param_comms is left out: it wraps point-to-point ops too (their own names say which they are)
_COLLECTIVE_MARKS = ("c10d::", "gloo:", "nccl", "_c10d_functional::")
# what the host computes in on CPU: eager operators and torch.compile's graphs (inductor's CPU
# kernels are C++ called from the graph, with no aten:: event of their own)
_OPERATOR_MARKS = ("aten::", "## Call CompiledFxGraph")


def is_p2p(name: str) -> bool:
    """A pipeline send or receive: c10d's point-to-point ops (`c10d::recv_`), gloo's (`gloo:recv`),
    NCCL's SendRecv kernels."""
    low = name.lower()
    return low.rsplit(":", 1)[-1].strip("_") in _P2P or "sendrecv" in low


def is_collective(name: str) -> bool:
    return any(mark in name.lower() for mark in _COLLECTIVE_MARKS) and not is_p2p(name)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def minus(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` that the union of `cover` does not cover."""
    return union_length(intervals + cover) - union_length(cover)


def clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """`intervals` as disjoint sorted intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def host_compute(events: list[tuple], thread: int) -> list[tuple[float, float]]:
    """When the step's thread runs an operator (`aten::`, a compiled graph), less the collective
    waits an operator holds (DTensor's redistribution inside its op): the CPU timeline's compute."""
    ops = merged((a, b) for n, a, b, _, t in events if t == thread and n.startswith(_OPERATOR_MARKS))
    starts = [a for a, _ in ops]
    holes = []
    for n, a, b, _, t in events:
        if t == thread and (is_collective(n) or is_p2p(n)):
            i = bisect.bisect_right(starts, a) - 1
            if i >= 0 and b <= ops[i][1]:  # held inside one operator: the thread waits there
                holes.append((a, b))
    return subtract(ops, merged(holes))


def subtract(
    intervals: list[tuple[float, float]], holes: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Disjoint sorted `intervals` less disjoint sorted `holes` (one pass over both)."""
    out, j = [], 0
    for a, b in intervals:
        while j < len(holes) and holes[j][1] <= a:
            j += 1
        k = j
        while k < len(holes) and holes[k][0] < b:
            if holes[k][0] > a:
                out.append((a, holes[k][0]))
            a = max(a, holes[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def breakdown(
    events: list[tuple[str, float, float, bool, int]], steps: list[tuple[float, float, int]]
) -> dict:
    """Mean seconds per step by part. `events`: (name, start_us, end_us, on_device, thread) of a
    trace; `steps`: each profiled step's (start_us, end_us, thread). The timeline is the device's
    kernels when there are any (CUDA), else the host's, where the step's thread computes while
    it runs an operator (host_compute)."""
    device = any(e[3] for e in events)
    line = [e for e in events if e[3] == device]
    comm = [(a, b) for n, a, b, *_ in line if is_collective(n)]
    p2p = [(a, b) for n, a, b, *_ in line if is_p2p(n)]
    if device:
        compute = [(a, b) for n, a, b, *_ in line if not is_collective(n) and not is_p2p(n)]
    else:
        compute = [iv for thread in {t for *_, t in steps} for iv in host_compute(events, thread)]
    regions = {
        p: [(a, b) for n, a, b, d, _ in events if n == name and not d]
        for p, name in (("data_s", DATA), ("optimizer_s", OPTIMIZER))
    }
    out = dict.fromkeys(PARTS, 0.0)
    for lo, hi, _ in steps:
        data, optim = clip(regions["data_s"], lo, hi), clip(regions["optimizer_s"], lo, hi)
        cover = clip(compute, lo, hi)
        comm_s = minus(clip(comm, lo, hi), cover + data + optim)
        p2p_s = minus(clip(p2p, lo, hi), cover + data + optim + clip(comm, lo, hi))
        out["data_s"] += union_length(data)
        out["optimizer_s"] += minus(optim, data)
        out["communication_s"] += comm_s
        out["pipeline_p2p_s"] += p2p_s
        out["compute_s"] += (hi - lo) - union_length(data + optim) - comm_s - p2p_s
    return {k: v / len(steps) / 1e6 for k, v in out.items()}


class StepProfiler:
    """Profiles steps `start` .. `start + steps - 1` of a run (`cfg`: the recipe's [profile])."""

    def __init__(self, cfg, run_dir: Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.folder = Path(run_dir) / "profile"
        self.steps = range(cfg.start_step, cfg.start_step + cfg.steps) if cfg.start_step else range(0)
        self._prof: profile | None = None

    def active(self, step: int) -> bool:
        return step in self.steps

    @contextlib.contextmanager
    def step(self, step: int):
        """Run `step` under the profiler when it is one of the profiled steps."""
        if not self.active(step):
            yield
            return
        if step == self.steps.start:
            self._start()
        with record_function(f"meshforge/step{step}"):
            yield

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
        if cuda and self.cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = profile(
            activities=activities, record_shapes=self.cfg.record_shapes, with_stack=self.cfg.with_stack
        )
        self._prof.__enter__()

    def finish(self, step: int) -> dict | None:
        """After the last profiled step: stop, write the trace (and snapshot), return this rank's
        breakdown (seconds per step by part); None on any other step."""
        if self._prof is None or step != self.steps[-1]:
            return None
        self._prof.__exit__(None, None, None)
        trace = self.folder / f"rank{self.rank}.pt.trace.json"
        self._prof.export_chrome_trace(str(trace))
        if self.device.type == "cuda" and self.cfg.memory_snapshot:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        events, steps = [], []
        for e in self._prof.events():
            on_device = e.device_type == torch.autograd.DeviceType.CUDA
            span = (e.time_range.start, e.time_range.end)
            if e.name.startswith("meshforge/step") and not on_device:
                steps.append((*span, e.thread))
            events.append((e.name, *span, on_device, e.thread))
        self._prof = None
        parts = breakdown(events, sorted(steps))
        (self.folder / f"rank{self.rank}-breakdown.json").write_text(json.dumps(parts, indent=1) + "\n")
        return parts
