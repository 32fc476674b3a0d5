"""One rank of a recipe's mesh, played without devices: torch's fake process group and a
meta-device model, parallelized exactly as a run would. Shardings, schedules and memory
traces of a 64-GPU recipe can be computed on a laptop."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshforge.configs import Recipe
from meshforge.core.topology import ParallelDims
from meshforge.models import args_from_config, get_model_spec
from meshforge.parallelisms import Meshes, ParallelModel, build_meshes, parallelize
from meshforge.run.launch.distributed import pick_device_type


@contextlib.contextmanager
def simulated_rank(recipe: Recipe, rank: int) -> Iterator[tuple[ParallelDims, Meshes, ParallelModel]]:
    """Rank `rank` of the recipe's mesh, parallelized on the meta device under torch's fake
    process group: shardings and schedules without devices, communication or memory."""
    dims = ParallelDims.from_config(recipe.mesh)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        meshes = build_meshes(dims, "cpu")
        spec = get_model_spec(recipe.model.name)
        with torch.device("meta"):
            model = spec.build(args_from_config(recipe.model))
        compile_off = dataclasses.replace(
            recipe.compile, enabled=False
        )  # shapes and plans do not depend on it
        pmodel = parallelize(
            model,
            meshes,
            dims,
            spec,
            tp=recipe.tp,
            pp=recipe.pp,
            cp=recipe.cp,
            seq_len=recipe.train.seq_len,
            device_type=pick_device_type(recipe.train.device),  # the run's kernels, traced on CPU
            ac=recipe.activation_checkpoint,
            compile=compile_off,
            fsdp=recipe.fsdp,
        )
        yield dims, meshes, pmodel
    finally:
        dist.destroy_process_group()


def trace_pool(workers: int | None = None) -> ProcessPoolExecutor:
    """Worker processes, one simulated rank per process: each starts clean (torch caches
    DTensor plans and sliced DeviceMeshes by mesh layout, which simulated ranks would share).
    Workers fork from a server that imported torch once, so a trace does not pay for it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["meshforge.simulate.estimate", "meshforge.simulate.sharding"])
    workers = workers or max(1, min(4, len(os.sched_getaffinity(0))))
    return ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=1)
