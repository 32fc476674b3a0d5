"""Per-rank memory measurements, and their reduction to max/min across ranks.

On CUDA: the caching allocator's stats. On CPU, `torch.cuda.memory_allocated()` would
silently return 0, so we measure the process instead: RSS, its high-water mark, and the
bytes held by the model's state tensors (parameters, gradients, optimizer state).
"""

from __future__ import annotations

import os
import resource
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (this rank's shards only)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_tensors(parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Parameters, their gradients, and the optimizers' per-parameter state."""
    out = []
    for part in parts:
        for p in part.parameters():
            out += [p, p.grad]
    for opt in optimizers:
        for state in opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def rank_memory(device: torch.device, state: int) -> dict[str, float]:
    """This rank's memory numbers, in bytes (counts for the CUDA retry/OOM counters)."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {
            "cuda_allocated": s.get("allocated_bytes.all.current", 0),
            "cuda_reserved": s.get("reserved_bytes.all.current", 0),
            "cuda_peak_active": s.get("active_bytes.all.peak", 0),
            "cuda_alloc_retries": s.get("num_alloc_retries", 0),
            "cuda_ooms": s.get("num_ooms", 0),
            "state": state,
        }
    return {
        "rss": _rss_bytes(),
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "state": state,
    }


def reduce_across_ranks(values: dict[str, float], device: torch.device,
                        prefix: str = "mem/") -> tuple[dict[str, float], list[dict]]:
    """{prefix+key_max, _min, _max_rank} over all ranks, and every rank's values (on all ranks)."""
    keys = sorted(values)
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
    else:
        gathered = [local]
    table = torch.stack(gathered).cpu()  # (ranks, keys)
    out: dict[str, float] = {}
    for j, k in enumerate(keys):
        col = table[:, j]
        out[f"{prefix}{k}_max"] = float(col.max())
        out[f"{prefix}{k}_min"] = float(col.min())
        out[f"{prefix}{k}_max_rank"] = int(col.argmax())
    per_rank = [{k: float(table[r, j]) for j, k in enumerate(keys)} for r in range(table.shape[0])]
    return out, per_rank
