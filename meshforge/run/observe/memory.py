"""Per-rank memory measurements, and their reduction to max/min across ranks.

On CUDA: the caching allocator's stats. On CPU, `torch.cuda.memory_allocated()` would
silently return 0, so we measure the process instead: RSS, its high-water mark, and the
bytes held by the model's state tensors (parameters, gradients, optimizer state: 16 bytes
a parameter in fp32 with AdamW).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from meshforge.core.tensors import local_tensor
from meshforge.core.units import GiB
from meshforge.run.rank.env import host_memory_bytes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (this rank's shards only)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """This rank's parameters, their gradients and the optimizers' per-parameter state, in bytes.
    Gradients are freed after every step (zero_grad(set_to_none=True)), so each trainable
    parameter's gradient is counted at its parameter's size: torch requires a gradient to have
    its parameter's dtype and shape, and this is what the step holds between backward and update."""
    params = [p for part in parts for p in part.parameters()]
    moments = [
        v
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return state_bytes(params + moments) + state_bytes(p for p in params if p.requires_grad)


# the per-rank peak each device type reports, and what it measures
PEAK = {"cuda": "max_active_gib", "cpu": "max_rss_gib"}
PEAK_MEANING = {"cuda": "CUDA peak active", "cpu": "peak RSS"}


# how many figures rank_memory returns per device type (the logged step gathers them over the world;
# the step-time model prices that gather)
LOGGED_FIGURES = {"cuda": 7, "cpu": 4}


def rank_memory(device: torch.device, state: int) -> dict[str, float]:
    """This rank's memory, named as TorchTitan names it, in GiB (and % of the device, and
    counts). CUDA peaks are reset after reading, so each logged step reports the peak since
    the one before; on CPU the OS keeps only the process's lifetime peak (max_rss)."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        active, reserved = s.get("active_bytes.all.peak", 0), s.get("reserved_bytes.all.peak", 0)
        torch.cuda.reset_peak_memory_stats(device)
        return {
            "max_active_gib": active / GiB,
            "max_active_pct": 100 * active / total,
            "max_reserved_gib": reserved / GiB,
            "max_reserved_pct": 100 * reserved / total,
            "num_alloc_retries": s.get("num_alloc_retries", 0),
            "num_ooms": s.get("num_ooms", 0),
            "state_gib": state / GiB,
        }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "rss_gib": _rss_bytes() / GiB,
        "max_rss_gib": peak / GiB,
        "max_rss_pct": 100 * peak / host_memory_bytes(),
        "state_gib": state / GiB,
    }


def gather_across_ranks(values: dict[str, float], device: torch.device) -> list[dict[str, float]]:
    """Every rank's `values` (the same keys on every rank), on every rank."""
    keys = sorted(values)
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
    else:
        gathered = [local]
    return [{k: float(v) for k, v in zip(keys, row.cpu().tolist())} for row in gathered]


def memory_metrics(
    values: dict[str, float], device: torch.device, prefix: str = "memory"
) -> tuple[dict[str, float], list[dict]]:
    """`<prefix>/<name>`: the largest rank's value (what decides an out-of-memory), with
    `<prefix>_min/<name>` and `<prefix>_rank/<name>` (which rank is largest) beside it; and every
    rank's values."""
    per_rank = gather_across_ranks(values, device)
    out: dict[str, float] = {}
    for k in values:
        col = [r[k] for r in per_rank]
        out[f"{prefix}/{k}"], out[f"{prefix}_min/{k}"] = max(col), min(col)
        out[f"{prefix}_rank/{k}"] = col.index(max(col))
    return out, per_rank


def start_memory_history(device: torch.device, max_entries: int = 100_000) -> None:
    """Record the CUDA caching allocator's events, so an out-of-memory can dump what led up to it."""
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_oom(
    run_dir,
    rank: int,
    device: torch.device,
    step: int,
    phase: str,
    estimate_bytes: float,
    error: BaseException,
) -> dict:
    """Write `oom-rank<r>.json` (and on CUDA the allocator snapshot `oom-rank<r>.pickle`,
    loadable at pytorch.org/memory_viz) and return the report with a message for the user."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "rank": rank,
        "step": step,
        "phase": phase,
        "device": str(device),
        "estimate_bytes_per_rank": estimate_bytes,
        "error": str(error).splitlines()[0] if str(error) else "",
    }
    if device.type == "cuda":
        snapshot = run_dir / f"oom-rank{rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(snapshot))
        report["snapshot"] = str(snapshot)
        report["device_bytes"] = torch.cuda.get_device_properties(device).total_memory
        report["memory_stats"] = {
            k: v
            for k, v in torch.cuda.memory_stats(device).items()
            if k
            in ("allocated_bytes.all.peak", "reserved_bytes.all.current", "num_ooms", "num_alloc_retries")
        }
    have = f" of {report['device_bytes'] / GiB:.1f} GiB" if "device_bytes" in report else ""
    report["message"] = (
        f"rank {rank} ran out of memory{have} in {phase} at step {step} (analytic estimate "
        f"{estimate_bytes / GiB:.2f} GiB per rank; `meshforge estimate RECIPE` traces it by category)"
        + (
            f"; allocator snapshot: {report['snapshot']} (open at https://pytorch.org/memory_viz)"
            if "snapshot" in report
            else ""
        )
        + ". Lower train.micro_batch_size, set activation_checkpoint.mode=full, or shard more "
        "(mesh.dp_shard, mesh.tp, mesh.pp; mesh.cp splits the sequence)"
    )
    (run_dir / f"oom-rank{rank}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
