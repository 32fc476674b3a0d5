"""`meshforge tune --calibrate`: measure this machine's hardware profile (CPU ranks, gloo).

One rank alone measures the compute rates, as `Profile` holds them (the step-time model divides
them between the ranks that share the cores); then `world` ranks measure the links as a step
meets them: every group of a size running its collective at once, each rank computing between
two collectives, so a collective's time includes the wait of a rank woken by its peers' data for
a core that computing ranks hold (8 ranks on 2 cores here: a group of 2's latency 3.7 ms, where
ranks doing nothing else measured 0.7 ms). Both run in processes forked from the rank server
(run/launch/rank_server.py): never from this process, whose OpenMP pool may not survive a fork,
and no interpreter start per rank.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from meshforge.core.errors import RunError, UsageError
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.run.launch.rank_server import start_rank_server
from meshforge.run.observe.flops import measure_cpu_matmul_flops, usable_cores
from meshforge.simulate.hardware import Link, Profile, algorithm_factor, load_profile, save_profile
from meshforge.simulate.host_probes import (
    WARMUP,
    dtensor_op_overhead,
    median_seconds,
    op_overhead,
    tiny_step,
)

# (m, k, n) of a small transformer's matmuls: q/k/v/o projections, an MLP up-projection, a
# long-sequence attention product. A dtype's rate is the median over them: one rate stands for
# every matmul of a step, and the median is the typical one, not pulled by a shape that suits
# (or misses) the cache.
SHAPES = ((2048, 256, 256), (2048, 256, 1024), (512, 512, 2048))
MATMUL_DTYPES = ("float32", "bfloat16")  # float16: CPUs have no fp16 matmul units (flops.py)
MEMORY_BYTES = 16 << 20  # per tensor of c = a + b: 3 x this moved, well past the caches
SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)  # full-buffer bytes of each timed collective
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
LOADED_REPEATS = 32  # bursts timed with and without the collective after each
TIMEOUT_S = 300  # a rank that hangs this long fails the calibration instead of the terminal


def calibrate(world: int, threads_per_rank: int, out: Path | None, console: Console) -> Profile:
    """Measure this machine, print a summary to `console`, write the profile to `out` (TOML) if
    given, and return it. Here (2 cores) about 8 s for world 2 and 40 s for world 8, most of it
    the links timed behind compute."""
    if world < 1 or threads_per_rank < 1:
        raise UsageError(f"calibrate needs world >= 1 and threads >= 1, not {world} and {threads_per_rank}")
    start = time.perf_counter()
    start_rank_server()
    with tempfile.TemporaryDirectory(prefix="meshforge-calibrate-") as tmp:
        rates = _launch(_measure_alone, 1, threads_per_rank, Path(tmp) / "alone")
        timings = _launch(_measure_links, world, threads_per_rank, Path(tmp) / "links") if world > 1 else []
    fits = {
        g: fit_link(g, [(kind, n, t) for size, kind, n, t in timings if size == g]) for g in _groups(world)
    }
    kind_links = _kind_links(timings, list(fits))
    node = platform.node() or "this machine"
    cores = usable_cores()
    profile = Profile(
        name=node,
        source=(
            f"measured by meshforge tune --calibrate on {node} ({platform.machine()}, {cores} usable cores) "
            f"at {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, gloo, "
            f"world {world}, {threads_per_rank} thread(s) per rank"
        ),
        matmul_flops=rates["matmul_flops"],
        memory_Bps=rates["memory_Bps"],
        ranks_per_node=world,
        shared_cores=cores,
        threads_per_rank=threads_per_rank,
        links={g: link for g, (link, _) in fits.items()},
        calibrated_world=world,
        op_overhead_s=rates["op_overhead_s"],
        dtensor_op_overhead_s=rates["dtensor_op_overhead_s"],
        peak_flops=rates["peak_flops"],
        kind_links=kind_links,
    )
    if out is not None:
        save_profile(profile, out)
    console.print(_summary(profile, {g: err for g, (_, err) in fits.items()}, len(SIZES) * len(COLLECTIVES)))
    where = f"; written to {out}" if out is not None else ""
    console.print(f"calibrated in {time.perf_counter() - start:.0f} s{where}", highlight=False)
    return profile


def fit_link(group_size: int, timings: list[tuple[str, int, float]]) -> tuple[Link, float]:
    """latency + bytes x factor / bandwidth fitted to (kind, full-buffer bytes, seconds) timings by
    least squares on the *relative* error, so the small sizes fix the latency and the large ones
    the bandwidth (absolute residuals would let the 4 MiB timings drown the latency). A timing
    behind compute is a difference of two loops, which noise can halve: while the fit misses a
    timing by over 50% (or finds no bandwidth), the one timing whose absence fits the rest best is
    left out, up to a quarter of them. Returns the link and the RMS relative error over all."""
    timings = [timing for timing in timings if timing[2] > 0]  # 0: noise drowned it (cost_under_load)
    if len(timings) < 2:
        raise RunError(
            f"calibration: too few collectives on groups of {group_size} took measurably longer than the "
            "compute around them; the machine was too busy to measure: calibrate again when it is quieter"
        )
    x = np.array([n * algorithm_factor(kind, group_size) for kind, n, _ in timings])
    t = np.array([seconds for _, _, seconds in timings])
    kept = np.arange(len(t))
    latency, per_byte = _relative_fit(x, t)
    for _ in range(len(t) // 4):
        if per_byte > 0 and np.abs((latency + per_byte * x[kept]) / t[kept] - 1).max() <= 0.5:
            break
        kept = min(
            (np.delete(kept, i) for i in range(len(kept))),
            key=lambda rest: _rms_miss(x[rest], t[rest], *_relative_fit(x[rest], t[rest])),
        )
        latency, per_byte = _relative_fit(x[kept], t[kept])
    if per_byte <= 0:
        raise RunError(
            f"calibration: collectives on groups of {group_size} took no longer for large buffers than "
            "for small ones; the machine was too busy to measure: calibrate again when it is quieter"
        )
    return Link(latency, 1 / per_byte), _rms_miss(x, t, latency, per_byte)


def _rms_miss(x: np.ndarray, t: np.ndarray, latency: float, per_byte: float) -> float:
    """The RMS relative error of a link on timings; infinite for one without a bandwidth."""
    return float(np.sqrt(np.mean(((latency + per_byte * x) / t - 1) ** 2))) if per_byte > 0 else np.inf


def _relative_fit(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(latency, seconds per byte) minimising the relative error; the bandwidth alone when noise
    puts the latency below zero."""
    (latency, per_byte), *_ = np.linalg.lstsq(np.stack([1 / t, x / t], axis=1), np.ones_like(t), rcond=None)
    if latency < 0:
        return 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    return float(latency), float(per_byte)


def _kind_links(timings: list, groups: list[int]) -> dict[str, dict[int, Link]]:
    """gloo's kinds differ beyond their algorithm factors (its reduce_scatter is slower): each its
    own fit per group size, from 4 timings; where noise leaves those no bandwidth, the kind keeps
    the size's pooled link (absent here, Profile.collective_time falls back to it)."""
    links: dict[str, dict[int, Link]] = {}
    for kind in COLLECTIVES:
        for g in groups:
            with contextlib.suppress(RunError):
                own = [(k, n, t) for size, k, n, t in timings if size == g and k == kind]
                links.setdefault(kind, {})[g] = fit_link(g, own)[0]
    return links


def _groups(world: int) -> list[int]:
    """The group sizes measured: every divisor of the world from 2 up."""
    return [g for g in range(2, world + 1) if world % g == 0]


def _launch(target: Callable[[int, int, int, str], None], world: int, threads: int, folder: Path) -> Any:
    """Run `target(rank, world, threads, folder)` in `world` processes forked from the rank server;
    rank 0 leaves its result in folder/result.json, which is returned."""
    folder.mkdir()
    context = multiprocessing.get_context("forkserver")
    ranks = [context.Process(target=target, args=(r, world, threads, str(folder))) for r in range(world)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    for p in ranks:
        p.join(max(0.0, deadline - time.monotonic()))
    failed = [(r, p.exitcode) for r, p in enumerate(ranks) if p.exitcode != 0]
    for p in ranks:
        if p.exitcode is None:
            p.kill()
            p.join()
    if failed:
        r, code = failed[0]
        why = f"exit code {code}" if code is not None else f"still running after {TIMEOUT_S} s"
        raise RunError(f"calibration: rank {r} of {world} failed ({why}); its error is above")
    return json.loads((folder / "result.json").read_text())


def cost_under_load(
    op: Callable[[], object],
    burst: Callable[[], object],
    sync: Callable[[], object],
    repeats: int = LOADED_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds `op` adds to each of `repeats` compute `burst`s: a loop of burst then op, less a
    loop of bursts alone, each loop started by `sync` (the world's barrier: every group starts
    together, as a step's ranks do). 0 where noise drowned the cost: fit_link leaves it out."""
    for _ in range(WARMUP):
        burst()
        op()
    sync()
    start = clock()
    for _ in range(repeats):
        burst()
    alone = clock() - start
    sync()
    start = clock()
    for _ in range(repeats):
        burst()
        op()
    return max(0.0, (clock() - start - alone) / repeats)


def _measure_alone(rank: int, world: int, threads: int, folder: str) -> None:
    """One rank alone: matmul FLOP/s per dtype and memory-bound bytes/s, with `threads` threads."""
    torch.set_num_threads(threads)
    matmul = {}
    for name in MATMUL_DTYPES:
        rates = []
        for m, k, n in SHAPES:
            a, b = torch.randn(m, k, dtype=DTYPES[name]), torch.randn(k, n, dtype=DTYPES[name])
            rates.append(2 * m * k * n / median_seconds(lambda: torch.mm(a, b)))
        matmul[name] = statistics.median(rates)
    a, b, c = (torch.ones(MEMORY_BYTES // 4) for _ in range(3))
    memory = 3 * MEMORY_BYTES / median_seconds(lambda: torch.add(a, b, out=c))
    # the MFU peak as a run measures it (flops.py), so tune's MFU is the run's
    peak = {name: measure_cpu_matmul_flops(dtype=DTYPES[name]) for name in MATMUL_DTYPES}
    result = {
        "matmul_flops": matmul,
        "memory_Bps": memory,
        "peak_flops": peak,
        "op_overhead_s": (per_op := op_overhead()),
        "dtensor_op_overhead_s": dtensor_op_overhead(per_op),
    }
    Path(folder, "result.json").write_text(json.dumps(result))


def _measure_links(rank: int, world: int, threads: int, folder: str) -> None:
    """One of `world` ranks: for each group size, the world split into consecutive groups, each
    group timing every collective at every size at once, behind a compute burst (the tiny
    layers' step) as a step's collectives sit behind its compute (cost_under_load); rank 0 keeps
    the median over ranks."""
    torch.set_num_threads(threads)
    store = dist.FileStore(str(Path(folder, "store")), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
    )
    burst = tiny_step()
    cases, seconds = [], []
    for g in _groups(world):
        group, _ = dist.new_subgroups(group_size=g)
        for kind in COLLECTIVES:
            for size in SIZES:
                numel = max(1, size // 4 // g) * g  # float32, a whole number of shards
                full, shard = torch.ones(numel), torch.ones(numel // g)
                op = {
                    "all_gather": lambda: dist.all_gather_single(full, shard, group=group),
                    "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full, group=group),
                    "all_reduce": lambda: dist.all_reduce(full, group=group),
                }[kind]
                cases.append((g, kind, numel * 4))
                seconds.append(cost_under_load(op, burst, dist.barrier))
    mine = torch.tensor(seconds, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    dist.destroy_process_group()
    if rank == 0:
        median = np.median(torch.stack(every).numpy(), axis=0)
        result = [[*case, float(t)] for case, t in zip(cases, median)]
        Path(folder, "result.json").write_text(json.dumps(result))


def _summary(profile: Profile, errors: dict[int, float], points: int) -> Table:
    table = Table(title=f"hardware profile {profile.name}", title_justify="left")
    for column in ("measured", "rate", "how"):
        table.add_column(column)
    alone = f"one rank alone, {profile.threads_per_rank} thread(s)"
    for dtype, rate in profile.matmul_flops.items():
        table.add_row(
            f"matmul {dtype}", f"{rate / 1e9:.1f} GFLOP/s", f"median of {len(SHAPES)} shapes, {alone}"
        )
    table.add_row(
        "memory-bound", f"{profile.memory_Bps / 1e9:.2f} GB/s", f"c = a + b on 16 MiB tensors, {alone}"
    )
    table.add_row("host work per op", f"{profile.op_overhead_s * 1e6:.1f} us", f"tiny layers' step, {alone}")
    table.add_row(
        "per DTensor op",
        f"{profile.dtensor_op_overhead_s * 1e6:.1f} us",
        "a TP block's DTensor ops (fake 2-rank mesh), beyond their local ops",
    )
    for g, link in sorted(profile.links.items()):
        table.add_row(
            f"groups of {g}",
            f"{link.latency_s * 1e6:.0f} us + busbw {link.bandwidth_Bps / 1e9:.2f} GB/s",
            f"{profile.calibrated_world // g} group(s) at once behind compute, fit to {points} timings "
            f"(RMS error {errors[g]:.0%})",
        )
    return table


def local_profile(
    name: str | None, recalibrate: bool, out: str | None, world: int, console: Console
) -> Profile:
    """The profile `meshforge tune` prices with: `name` (shipped or a file), or this machine's for
    `world` ranks, calibrated now (`recalibrate`, or the first time) and kept at `out` (default
    ./meshforge-profile-<host>-w<world>.toml) for the next tune. Ranks get the threads a run gives
    them (train.cpu_threads = 0: the cores over the local ranks)."""
    if name and recalibrate:
        raise UsageError(f"--profile {name} and --calibrate: pick one (--calibrate measures this machine)")
    if name:
        return load_profile(name)
    path = Path(out or f"meshforge-profile-{platform.node() or 'local'}-w{world}.toml")
    if path.is_file() and not recalibrate:
        console.print(
            f"hardware profile: {path} (calibrated earlier; --calibrate measures again)", highlight=False
        )
        return load_profile(path)
    return calibrate(world, max(1, (os.cpu_count() or 1) // world), path, console)
