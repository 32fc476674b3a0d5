"""What sharing CPU cores costs beyond each rank's equal share of them, as `meshforge tune
--calibrate` measures it: the tiny Llama's step (host_probes) timed on one rank alone, then on n
ranks at once for every n of the calibrated world whose threads outnumber the cores. On this
project's 2 cores calibrations read 1.10-1.11 for 4 ranks and 1.15-1.16 for 8 (a step's time over
its equal share of the cores): context switches, and caches refilled after each (spawned processes
stepping longer read 1.02-1.16 and 1.21-1.31; a matmul whose operands stay in L2 lost 1-5% at 8
ranks, one with a 4 MiB operand 30%)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshforge.simulate.hardware import cores_one_rank_uses
from meshforge.simulate.host_probes import WARMUP, tiny_llama_step

STEPS = 100  # steps per timing: ~1 s with 8 ranks on 2 cores (20 read no slowdown: too short)
ROUNDS = 3  # timings per count, the fastest kept: a busy neighbour on a shared host only slows


def counts_to_measure(world: int, threads: int, cores: int) -> list[int]:
    """The counts of ranks computing at once whose slowdown is measured: the divisors of the world
    (the groups that compute together: a layout's dp, cp, tp peers) with more threads than cores."""
    return [n for n in range(2, world + 1) if world % n == 0 and n * threads > cores]


def measure_sharing(
    rank: int, world: int, threads: int, folder: str, device: str, cores: int, timeout_s: float
) -> None:
    """One of `world` ranks: each count's ranks (the first n) step the tiny Llama at once, the rest
    wait; rank 0 writes {n: slowdown} to folder/result.json, the slowdown being the median rank's
    seconds a step over its equal share's (alone x n x the cores one rank used / cores), at least 1
    (faster than an equal share is noise). `cores` comes from the caller, so every rank measures
    the same counts (their collectives must match). CPU ranks only (`device`: the launcher's)."""
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(str(Path(folder, "store")), world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    step = tiny_llama_step()
    for _ in range(WARMUP):
        step()
    seconds = {}
    for n in [1, *counts_to_measure(world, threads, cores)]:
        readings = []
        for _ in range(ROUNDS):
            dist.barrier()
            mine = torch.tensor([_seconds_per_step(step) if rank < n else 0.0], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            readings.append(statistics.median(float(t) for t in every[:n]))
        seconds[n] = min(readings)
    dist.destroy_process_group()
    if rank == 0:
        alone = seconds.pop(1)
        used = cores_one_rank_uses(threads, cores)
        slowdown = {n: max(1.0, s / (alone * n * used / cores)) for n, s in seconds.items()}
        Path(folder, "result.json").write_text(json.dumps(slowdown))


def _seconds_per_step(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS
