"""What ranks sharing CPU cores lose, as `meshforge tune --calibrate` measures it, in one launch of
the calibrated world:

- their slowdown beyond each rank's equal share of the cores: a Llama's step timed on one rank
  alone, then on n ranks at once for every n of the world whose threads outnumber the cores
  (context switches, and caches refilled after each). The step is the reference Llama's
  (rate_probes) on 128 tokens: a bigger working set loses more, and the tiny Llama's (dim 16) read
  1.00-1.16 for 8 ranks here where this one read 1.17-1.18 within minutes of a 1.11-1.14.
- a collective's wait for its group's last rank (`arrival_skew`): ranks that computed for the same
  work arrive at a collective apart, the more apart the longer they computed (the scheduler's
  slices fall unevenly). Per group size, the extra seconds a small all-reduce takes behind the
  reference step over behind a short one, per second of the bursts' difference: here ~0.03-0.08
  for groups of 2, 0.17-0.30 of 4, 0.29-0.39 of 8. The lateness stops growing after a few
  scheduler rounds (`arrival_skew_cap`): behind 1, 2, 4 and 8 reference steps on groups of 8 the
  extra wait read 13-14, 16-24, 27-33 and 25-32 ms, so it is also read behind 4 of them (groups of
  2 read 4, 2, 3 and 10 ms: not settled by 4, the larger of the two readings is kept).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshforge.simulate.hardware import MAX_ARRIVAL_SKEW, MAX_ARRIVAL_SKEW_CAP_S, cores_one_rank_uses
from meshforge.simulate.host_probes import WARMUP, tiny_step
from meshforge.simulate.rate_probes import reference_llama_step

SHARING_TOKENS = (1, 128)  # the reference Llama's step on 128 tokens: ~11 ms alone here, ~55 ms on 8 ranks
STEPS = 20  # steps per timing: ~1 s with 8 ranks on 2 cores
ROUNDS = 3  # timings per count, interleaved; the fastest kept: a busy neighbour on a shared host only slows
SKEW_REPEATS = 16  # bursts each followed by the collective, per burst length and group size
SATURATING_STEPS = 4  # reference steps in the burst whose wait reads the cap (~230 ms on 8 ranks here)


def group_sizes(world: int) -> list[int]:
    """The group sizes calibrate measures: every divisor of the world from 2 up."""
    return [g for g in range(2, world + 1) if world % g == 0]


def counts_to_measure(world: int, threads: int, cores: int) -> list[int]:
    """The counts of ranks computing at once whose slowdown is measured: the divisors of the world
    (the groups that compute together: a layout's dp, cp, tp peers) with more threads than cores."""
    return [n for n in range(2, world + 1) if world % n == 0 and n * threads > cores]


def measure_sharing(
    rank: int, world: int, threads: int, folder: str, device: str, cores: int, timeout_s: float
) -> None:
    """One of `world` ranks: rank 0 writes {"slowdown": {n: x}, "arrival_skew": {g: fraction},
    "arrival_skew_cap": {g: seconds}} to folder/result.json (module doc), each the median rank's
    reading. The slowdown is a step's seconds over its equal share's (alone x n x the cores one
    rank used / cores), at least 1 (faster than an equal share is noise). `cores` comes from the
    caller, so every rank measures the same counts (their collectives must match). CPU ranks only
    (`device`: the launcher's)."""
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(str(Path(folder, "store")), world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    step = reference_llama_step(SHARING_TOKENS)
    for _ in range(WARMUP):
        step()
    counts = [1, *counts_to_measure(world, threads, cores)]
    seconds: dict[int, float] = {}
    for _ in range(ROUNDS):  # rounds interleaved: a host that drifts moves every count alike
        for n in counts:
            dist.barrier()
            mine = _seconds_per_step(step) if rank < n else 0.0
            reading = statistics.median(_gathered([mine])[:n, 0].tolist())
            seconds[n] = min(seconds.get(n, reading), reading)
    groups, short = group_sizes(world), tiny_step()
    skews = _gathered([v for g in groups for v in arrival_skew(g, step, short)]).median(dim=0).values
    dist.destroy_process_group()
    if rank == 0:
        alone = seconds.pop(1)
        used = cores_one_rank_uses(threads, cores)
        slowdown = {n: max(1.0, s / (alone * n * used / cores)) for n, s in seconds.items()}
        skew = {g: min(MAX_ARRIVAL_SKEW, max(0.0, float(f))) for g, f in zip(groups, skews[0::2])}
        cap = {g: min(MAX_ARRIVAL_SKEW_CAP_S, max(0.0, float(c))) for g, c in zip(groups, skews[1::2])}
        result = {"slowdown": slowdown, "arrival_skew": skew, "arrival_skew_cap": cap}
        Path(folder, "result.json").write_text(json.dumps(result))


def arrival_skew(group_size: int, long: Callable[[], None], short: Callable[[], None]) -> tuple[float, float]:
    """This rank's extra wait in a small all-reduce on groups of `group_size` (the world split into
    consecutive groups, all at once) behind the `long` burst over behind the `short` one, per
    second the bursts differ; and its extra wait behind SATURATING_STEPS long bursts or behind
    one, the larger, in seconds (the cap: at least the lateness already read, so a noisy reading
    never caps the wait below it). Each burst and each collective timed on its own, so no two long loops are
    subtracted (their noise drowned the wait)."""
    group, _ = dist.new_subgroups(group_size=group_size)
    buffer = torch.ones(1024)

    def timed(burst: Callable[[], None], repeats: int = SKEW_REPEATS) -> tuple[float, float]:
        for _ in range(WARMUP):
            burst()
            dist.all_reduce(buffer, group=group)
        dist.barrier()
        computing = waiting = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            burst()
            done = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            computing, waiting = computing + done - start, waiting + time.perf_counter() - done
        return computing / repeats, waiting / repeats

    def saturating() -> None:
        for _ in range(SATURATING_STEPS):
            long()

    long_burst, long_wait = timed(long)
    short_burst, short_wait = timed(short)
    _, saturated_wait = timed(saturating, SKEW_REPEATS // 2)
    share = (long_wait - short_wait) / max(long_burst - short_burst, 1e-9)
    return share, max(saturated_wait, long_wait) - short_wait


def _gathered(values: list[float]) -> torch.Tensor:
    """Every rank's `values`, one row per rank."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every)


def _seconds_per_step(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS
