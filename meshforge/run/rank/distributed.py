"""Process-group and device set-up from torchrun's environment (or none, for one process)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# defined in the light rank_server module: the CLI asks it before importing torch
from meshforge.run.rank.env import under_torchrun

# Collective timeout: long enough for a slow first compile, short enough that a dead
# rank ends the job instead of hanging it.
COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("MESHFORGE_COLLECTIVE_TIMEOUT", "300")))


def env_world_size() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse instead of returning it to the OS
    (mmap threshold, trim threshold and top pad raised to 1 GiB / 1 GiB / 256 MiB): a CPU
    training step frees and reallocates the same large activations every step, and each
    fresh mmap costs page faults. Measured here: +3-5% tokens/s on one process. No effect on
    the numbers computed; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1
    ok &= libc.mallopt(m_trim_threshold, 1 << 30) == 1
    return ok and libc.mallopt(m_top_pad, 256 << 20) == 1


def pick_device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def setup(device_request: str, cpu_threads: int = 0, group_of_one: bool = False) -> DistEnv:
    """Init the process group when there is more than one rank (or, with `group_of_one`, for
    one process alone: FSDP needs a mesh); choose device and threads."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device_type = pick_device_type(device_request)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # share the cores between the local processes instead of oversubscribing them
        torch.set_num_threads(cpu_threads or max(1, (os.cpu_count() or 1) // local_world))
        keep_freed_host_memory()
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
    device_id = device if device_type == "cuda" else None
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT, device_id=device_id)
    elif group_of_one and not dist.is_initialized():
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id
        )
    return DistEnv(rank, local_rank, world, local_world, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(value):
    """Rank 0's `value` on every rank (itself without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
