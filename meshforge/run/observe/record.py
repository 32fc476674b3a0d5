"""A run's lifecycle on disk, one object for the torch and JAX trainers alike: `run.json`
(status, resolved recipe, versions, summary), the run id, and records that continue
without duplicate steps on resume. `metrics.jsonl` itself is written by the loggers."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

import meshforge
from meshforge.core.files import write_atomic
from meshforge.run.observe.memory import PEAK
from meshforge.run.observe.set_aside import set_aside_past


def write_json_atomic(path: Path, data: dict) -> None:
    """Write via a temporary file + rename, so a killed run never leaves half a file."""
    write_atomic(path, json.dumps(data, indent=2, default=str))


@dataclass(frozen=True)
class StepTime:
    """One step's tokens and wall time: from the end of the previous step to the end of this
    one, so data, logging and checkpoints are all counted once. `excluded` says why the
    throughput summary leaves the step out (None: a steady step)."""

    step: int
    tokens: int
    seconds: float
    excluded: str | None = None  # "warmup" | "memory_tracking" | "checkpoint" | "eval"


def exclusion(
    nth_step: int, warmup: int, *, tracked: bool, saved: bool, evaluated: bool = False, profiled: bool = False
) -> str | None:
    """Why a step (the `nth_step` of this process) is not a steady one: the one rule."""
    if nth_step <= warmup:
        return "warmup"
    if tracked or profiled:
        return "memory_tracking" if tracked else "profiling"
    return "checkpoint" if saved else "eval" if evaluated else None


def step_times_of_rows(rows: list[dict], warmup: int) -> list[StepTime]:
    """The logged steps of a `metrics.jsonl` as StepTimes, under the rule the trainer uses."""
    out = []
    for i, row in enumerate(r for r in rows if "step_time" in r):
        tracked = any(k.startswith("mem_breakdown/") for k in row)
        saved, evaluated, profiled = "checkpoint_seconds" in row, "eval/loss" in row, "profile/active" in row
        excluded = exclusion(
            i + 1, warmup, tracked=tracked, saved=saved, evaluated=evaluated, profiled=profiled
        )
        tokens = round(row["tokens_per_sec"] * row["step_time"])
        out.append(StepTime(row["step"], tokens, row["step_time"], excluded))
    return out


def steady_throughput(times: list[StepTime]) -> dict:
    """Tokens over time across the steady steps (all ranks), and which steps were left out.
    A run too short to have steady steps counts all but its first (or its only) step."""
    counted = [t for t in times if t.excluded is None] or times[1:] or times
    excluded: dict[str, list[int]] = {}
    for t in times:
        if t not in counted:
            excluded.setdefault(t.excluded or "first", []).append(t.step)
    seconds = sum(t.seconds for t in counted)
    return {
        "tokens_per_sec": sum(t.tokens for t in counted) / seconds if seconds else 0.0,
        "step_time": seconds / len(counted) if counted else 0.0,
        "throughput_steps": {"counted": len(counted), "excluded": excluded},
    }


@dataclass
class RunState:
    """What the loop has seen so far, for the summary."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    times: list[StepTime] = field(default_factory=list)
    last_memory: dict = field(default_factory=dict)
    per_rank_memory: list = field(default_factory=list)
    memory_breakdown: list = field(
        default_factory=list
    )  # per rank: category -> bytes at the tracked step's peak
    memory_breakdown_step: int = 0


@dataclass(frozen=True)
class Throughput:
    """The run's constants that turn tokens/s into FLOP/s and MFU."""

    flops_per_token: float
    world_size: int
    peak_flops: float | None  # per device; None where unknown
    device_type: str

    def rates(self, tokens: int, seconds: float) -> dict[str, float]:
        """One step's tokens/s (all ranks, and per device), its time, TFLOP/s per device and MFU."""
        tokens_per_sec = tokens / seconds
        flops_per_device = self.flops_per_token * tokens_per_sec / self.world_size
        out = {
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": tokens_per_sec / self.world_size,
            "step_time": seconds,
            "tflops_per_device": flops_per_device / 1e12,
        }
        if self.peak_flops:
            out["mfu"] = flops_per_device / self.peak_flops
        return out


def summarize(st: RunState, tp: Throughput, loss_floor: float | None = None) -> dict:
    """The run's summary: losses, steady throughput (`steady_throughput`), MFU, and memory."""
    out: dict = {"steps": st.step}
    if st.losses:
        steady = steady_throughput(st.times)
        tps = steady["tokens_per_sec"]
        out.update(
            final_loss=st.losses[-1],
            best_loss=min(st.losses),
            **steady,
            tokens_per_sec_per_device=tps / tp.world_size,
            tflops_per_device=tp.flops_per_token * tps / tp.world_size / 1e12,
        )
        if tp.peak_flops:
            out["mfu"] = out["tflops_per_device"] * 1e12 / tp.peak_flops
            out["peak_tflops_per_device"] = tp.peak_flops / 1e12
        saves = [t.seconds for t in st.times if t.excluded == "checkpoint"]
        if saves and steady["step_time"]:
            # what a checkpoint step costs beyond a steady step (async saves should cost little)
            out["checkpoint_step_overhead_s"] = sum(saves) / len(saves) - steady["step_time"]
    if loss_floor is not None:
        out["loss_floor"] = loss_floor
    if st.per_rank_memory:
        out["per_rank_memory"] = st.per_rank_memory
    if st.memory_breakdown:
        out["memory_breakdown"] = {"step": st.memory_breakdown_step, "per_rank": st.memory_breakdown}
    peak_key = f"memory/{PEAK[tp.device_type]}"
    if peak_key in st.last_memory:
        out["peak_memory_gib"] = st.last_memory[peak_key]
    return out


def _earlier_run_id(run_json: Path) -> str | None:
    """The run id of the records a run continues (`checkpoint.load=auto` before any checkpoint)."""
    try:
        return json.loads(run_json.read_text()).get("run_id")
    except (OSError, ValueError):
        return None


class RunRecord:
    """`<run>/run.json` from start to end. Opened by the one process that logs (rank 0)."""

    def __init__(self, run_dir: Path, run_name: str, info: dict, resumed: dict | None = None):
        """`info`: what this run is (recipe, mesh, device, ...); `resumed`: {path, step,
        run_id} of the checkpoint it continues, whose run id and records it keeps."""
        self.run_dir = run_dir
        self.path = run_dir / "run.json"
        resumed = resumed or {}
        run_dir.mkdir(parents=True, exist_ok=True)
        # the steps after the checkpoint are logged again: their records are set aside, the record cut back
        self.set_aside = set_aside_past(run_dir, resumed["step"]) if resumed else None
        versions = {
            "meshforge": meshforge.__version__,
            "torch": torch.__version__,
            **info.pop("versions", {}),
        }
        self.info = {
            "run_id": resumed.get("run_id")
            or (resumed and _earlier_run_id(self.path))
            or f"{run_name}-{uuid.uuid4().hex[:8]}",
            "resumed_from": resumed.get("path"),
            "run_name": run_name,
            "status": "running",
            "start_time": time.time(),
            **info,
            "versions": versions,
            "records": {"metrics": str(run_dir / "metrics.jsonl")},
        }
        if self.set_aside:
            self.info["set_aside"] = {"steps": self.set_aside.steps, "to": str(self.set_aside.to)}
        self.write()

    @property
    def run_id(self) -> str:
        return self.info["run_id"]

    def write(self) -> None:
        write_json_atomic(self.path, self.info)

    def fail(self, error: BaseException | str) -> None:
        """Note the error (written at `close`)."""
        self.info["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def close(self, status: str, summary: dict) -> None:
        self.info.update(status=status, end_time=time.time(), summary=summary)
        self.write()


def mark_failed(run_json: Path, error: str, status: str = "failed") -> None:
    """Close the record of a run whose rank 0 was stopped mid-collective (the launcher knows
    which rank failed first), or by a signal before its loop could stop it (`preempted`)."""
    if not run_json.is_file():
        return
    info = json.loads(run_json.read_text())
    if info.get("status") not in ("finished", "preempted"):
        info.setdefault("end_time", time.time())
        info.update(status=status, error=error)
        write_json_atomic(run_json, info)
