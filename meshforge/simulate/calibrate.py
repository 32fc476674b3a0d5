"""`meshforge tune --calibrate`: measure this machine's hardware profile (CPU ranks and gloo, or
one GPU's compute).

One rank alone measures the compute rates, as `Profile` holds them (the step-time model divides
them between the ranks that share the cores); then `world` ranks measure the links as a step
meets them: every group of a size running its collective at once, each rank computing between
two collectives, so a collective's time includes the wait of a rank woken by its peers' data for
a core that computing ranks hold (8 ranks on 2 cores here: a group of 2's latency 3.7 ms, where
ranks doing nothing else measured 0.7 ms). Both run in processes forked from the rank server
(run/launch/rank_server.py): never from this process, whose OpenMP pool may not survive a fork,
and no interpreter start per rank. On a GPU (the recipe's device) one rank measures the GPU's
compute at a transformer's sizes; links between GPUs (NCCL) are not measured yet.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console

from meshforge.core.errors import RunError, UsageError
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.run.launch.rank_server import start_rank_server
from meshforge.run.observe.flops import gpu_peak_flops, measure_cpu_matmul_flops, usable_cores
from meshforge.run.train.paced_gc import collector_off
from meshforge.simulate.core_sharing import group_sizes, measure_sharing
from meshforge.simulate.hardware import Profile
from meshforge.simulate.host_probes import PROBE_ROUNDS, WARMUP, host_costs, tiny_step
from meshforge.simulate.link_fit import fit_kind_links, fit_link
from meshforge.simulate.profile_table import profile_table
from meshforge.simulate.profile_toml import load_profile, save_profile
from meshforge.simulate.rate_probes import compute_rates, model_rate_share

SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)  # full-buffer bytes of each timed collective
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
LOADED_REPEATS = 32  # bursts timed with and without the collective after each
TIMEOUT_S = 300  # a rank that hangs this long fails the calibration instead of the terminal


def calibrate(
    world: int, threads_per_rank: int, out: Path | None, console: Console, device: str = "cpu"
) -> Profile:
    """Measure this machine, print a summary to `console`, write the profile to `out` (TOML) if
    given, and return it. Here (2 cores) about 10 s for world 2 and 55 s for world 8, most of it
    the links timed behind compute."""
    if world < 1 or threads_per_rank < 1:
        raise UsageError(f"calibrate needs world >= 1 and threads >= 1, not {world} and {threads_per_rank}")
    if device == "cuda":
        return _calibrate_gpu(world, out, console)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshforge-calibrate-") as tmp:
        rates = _launch(_measure_alone, 1, threads_per_rank, Path(tmp) / "alone", "cpu")
        timings = (
            _launch(_measure_links, world, threads_per_rank, Path(tmp) / "links", "cpu") if world > 1 else []
        )
        cores = usable_cores()
        # beyond their share of the cores, and a collective's wait for its group's last rank
        sharing = partial(measure_sharing, cores=cores, timeout_s=TIMEOUT_S)
        lost = _launch(sharing, world, threads_per_rank, Path(tmp) / "sharing", "cpu") if world > 1 else {}
    collectives = [timing for timing in timings if timing[1] != "send"]  # a send is not a collective's
    fits = {
        g: fit_link(g, [(kind, n, t) for size, kind, n, t in collectives if size == g])
        for g in group_sizes(world)
    }
    kind_links = fit_kind_links(timings, list(fits), (*COLLECTIVES, "send"))
    node = platform.node() or "this machine"
    profile = Profile(
        name=node,
        source=(
            f"measured by meshforge tune --calibrate on {node} ({platform.machine()}, {cores} usable cores) "
            f"at {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, gloo, "
            f"world {world}, {threads_per_rank} thread(s) per rank"
        ),
        matmul_flops=rates["matmul_flops"],
        attention_flops=rates["attention_flops"],
        memory_Bps=rates["memory_Bps"],
        ranks_per_node=world,
        shared_cores=cores,
        threads_per_rank=threads_per_rank,
        links={g: link for g, (link, _) in fits.items()},
        calibrated_world=world,
        op_overhead_s=rates["op_overhead_s"],
        dtensor_op_overhead_s=rates["dtensor_op_overhead_s"],
        fsdp_unit_overhead_s=rates["fsdp_unit_overhead_s"],
        checkpoint_overhead_s=rates["checkpoint_overhead_s"],
        model_rate_share=rates["model_rate_share"],
        peak_flops=rates["peak_flops"],
        kind_links=kind_links,
        sharing_slowdown={int(n): s for n, s in lost.get("slowdown", {}).items()},
        arrival_skew={int(g): f for g, f in lost.get("arrival_skew", {}).items()},
        arrival_skew_cap={int(g): c for g, c in lost.get("arrival_skew_cap", {}).items()},
    )
    _keep(profile, out, console, start, {g: err for g, (_, err) in fits.items()})
    return profile


def _calibrate_gpu(world: int, out: Path | None, console: Console) -> Profile:
    """One GPU's compute: matmul rates per dtype, HBM bandwidth, the host's work per op. The
    profile has no links: tune prices a layout of one GPU, and refuses more until [links.N]
    tables are added (a shipped profile's, or nccl-tests' busbw for this cluster)."""
    if not torch.cuda.is_available():
        raise UsageError(
            "the recipe runs on cuda and this machine has no CUDA device: calibrate on the GPU node, "
            "or tune with --profile h100, h200 or a profile file"
        )
    if world > 1:
        fix = (
            "tune with --profile h100 or h200 as they are, or calibrate one GPU (--world 1 "
            "--calibrate --profile-out gpu.toml), copy [links.N] and [inter_node] from a shipped "
            "profile (or nccl-tests' bus bandwidths) into gpu.toml, and tune with --profile gpu.toml"
        )
        raise UsageError(f"calibrating {world} GPUs: measuring NCCL links is not implemented; {fix}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshforge-calibrate-") as tmp:
        rates = _launch(_measure_alone, 1, 1, Path(tmp) / "alone", "cuda")
    name = rates.pop("device_name")
    profile = Profile(
        name=name,
        source=(
            f"measured by meshforge tune --calibrate on one {name} of {platform.node() or 'this machine'} "
            f"at {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}: compute only, "
            "no links (add [links.N] tables for layouts of several GPUs)"
        ),
        ranks_per_node=rates.pop("device_count"),
        calibrated_world=1,
        **rates,
    )
    _keep(profile, out, console, start, {})
    return profile


def _keep(profile: Profile, out: Path | None, console: Console, start: float, errors: dict) -> None:
    """Write the profile to `out` (if given) and print its summary."""
    if out is not None:
        save_profile(profile, out)
    console.print(profile_table(profile, errors, len(SIZES) * len(COLLECTIVES)))
    where = f"; written to {out}" if out is not None else ""
    console.print(f"calibrated in {time.perf_counter() - start:.0f} s{where}", highlight=False)


def _launch(target: Callable[..., None], world: int, threads: int, folder: Path, device: str) -> Any:
    """Run `target(rank, world, threads, folder, device)` in `world` processes (CPU ranks forked
    from the rank server, a GPU's spawned); rank 0 leaves its result in folder/result.json, which
    is returned."""
    folder.mkdir()
    if device == "cuda":  # as run/launch/local.py starts CUDA ranks: nothing that may touch CUDA is forked
        context = multiprocessing.get_context("spawn")
    else:
        start_rank_server()
        context = multiprocessing.get_context("forkserver")
    ranks = [
        context.Process(target=_as_training_runs, args=(target, r, world, threads, str(folder), device))
        for r in range(world)
    ]
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


def _as_training_runs(target: Callable[..., None], *args) -> None:
    """A probe's rank with Python's collector as a run's steps have it (train.gc_every): off, so no
    rank's own collection is measured as its peers' wait."""
    with collector_off():
        target(*args)


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


def _measure_alone(rank: int, world: int, threads: int, folder: str, device: str) -> None:
    """One rank alone (with `threads` threads on a CPU; or one GPU): matmul and attention FLOP/s per
    dtype, memory-bound bytes/s (rate_probes.py), the host's work per op, per DTensor op, per
    FSDP unit and per checkpointed block."""
    torch.set_num_threads(threads)
    gpu = device == "cuda"
    result = compute_rates(device, PROBE_ROUNDS)
    result.update(host_costs(device)[0])
    if gpu:  # MFU against the datasheet, as a run reports it (flops.py)
        gpu_device = torch.device("cuda", 0)
        peaks = {name: gpu_peak_flops(gpu_device, name) for name in result["matmul_flops"]}
        result["peak_flops"] = {name: peak for name, peak in peaks.items() if peak}
        result["device_name"] = torch.cuda.get_device_name(gpu_device)
        result["device_count"] = torch.cuda.device_count()
        result["device_memory_gib"] = torch.cuda.get_device_properties(gpu_device).total_memory / 2**30
    else:  # the MFU peak as a run measures it (flops.py), so tune's MFU is the run's; and the share
        # of the rates a model's step reaches (on a GPU the host runs ahead of the device, so a
        # step's seconds are not its arithmetic plus its host work: the shipped rates are achievable)
        result["model_rate_share"] = max(
            model_rate_share(result, result["op_overhead_s"]) for _ in range(PROBE_ROUNDS)
        )
        result["peak_flops"] = {
            name: measure_cpu_matmul_flops(dtype=DTYPES[name]) for name in result["matmul_flops"]
        }
    Path(folder, "result.json").write_text(json.dumps(result))


def _measure_links(rank: int, world: int, threads: int, folder: str, device: str) -> None:
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
    for g in group_sizes(world):
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
    for size in SIZES if world % 2 == 0 else ():  # a pipeline's send: a pair's ranks exchange
        out, into = torch.ones(size // 4), torch.empty(size // 4)
        cases.append((2, "send", size))
        seconds.append(cost_under_load(lambda: _exchange(out, into, rank ^ 1), burst, dist.barrier))
    mine = torch.tensor(seconds, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    dist.destroy_process_group()
    if rank == 0:
        median = np.median(torch.stack(every).numpy(), axis=0)
        result = [[*case, float(t)] for case, t in zip(cases, median)]
        Path(folder, "result.json").write_text(json.dumps(result))


def _exchange(out: torch.Tensor, into: torch.Tensor, peer: int) -> None:
    """Send `out` to `peer` while receiving `into` from it, as a pipeline stage's P2P runs."""
    ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def local_profile(
    name: str | None, recalibrate: bool, out: str | None, world: int, console: Console, device: str = "cpu"
) -> Profile:
    """The profile `meshforge tune` prices with: `name` (shipped or a file), or this machine's for
    `world` ranks on `device` (the recipe's), calibrated now (`recalibrate`, or the first time) and
    kept at `out` (default ./meshforge-profile-<host>[-cuda]-w<world>.toml) for the next tune; one
    measured on the other kind of device is refused (CPU ranks and a GPU are priced apart). CPU ranks
    get the threads a run gives them (train.cpu_threads = 0: the cores over the local ranks)."""
    if name and recalibrate:
        raise UsageError(f"--profile {name} and --calibrate: pick one (--calibrate measures this machine)")
    if name:
        return load_profile(name)
    where = "cuda-" if device == "cuda" else ""
    path = Path(out or f"meshforge-profile-{platform.node() or 'local'}-{where}w{world}.toml")
    if path.is_file() and not recalibrate:
        console.print(
            f"hardware profile: {path} (calibrated earlier; --calibrate measures again)", highlight=False
        )
        profile = load_profile(path)
        if (profile.shared_cores == 0) != (device == "cuda"):  # each is priced by its own model
            measured = "CPU ranks" if profile.shared_cores else "a GPU"
            raise UsageError(
                f"{path} measured {measured}, but the recipe runs on {device}: --calibrate to measure "
                "this device, or --profile another file"
            )
        return profile
    return calibrate(world, max(1, (os.cpu_count() or 1) // world), path, console, device)
