"""One rank of a recipe's mesh, played without devices: torch's fake process group and a
meta-device model, parallelized exactly as a run would. Shardings, schedules and memory
traces of a 64-GPU recipe can be computed on a laptop."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import multiprocessing.forkserver
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import _disable_current_modes

from meshforge.configs import Recipe
from meshforge.core.topology import ParallelDims
from meshforge.models import args_from_config, get_model_spec
from meshforge.parallelisms import Meshes, ParallelModel, build_meshes, parallelize
from meshforge.run.observe.flops import usable_cores
from meshforge.run.rank.distributed import pick_device_type


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
            float8=recipe.float8,
        )
        yield dims, meshes, pmodel
    finally:
        dist.destroy_process_group()


class TracePool(ProcessPoolExecutor):
    """A process pool that, left by an error or Ctrl-C, drops the traces not yet started (a
    sweep's pending traces took minutes to wind down before it said which jobs it left to the
    scheduler); the running ones end first (not waiting for them, wait=False, breaks Python
    3.11's pool of workers that serve one task each: its manager thread fails respawning one)."""

    def __exit__(self, kind, value, traceback) -> bool:
        self.shutdown(wait=True, cancel_futures=kind is not None)
        return False


def trace_pool(workers: int | None = None) -> TracePool:
    """Worker processes, one simulated rank per process: each starts clean (torch caches
    DTensor plans and sliced DeviceMeshes by mesh layout, which simulated ranks would share).
    Workers fork from a server that imported torch once, so a trace does not pay for it. A
    worker runs one task (a trace, or a rank's shallow pair: trace_depths) and exits, its garbage
    with it: the cyclic collector is off there (its passes over fake tensors and autograd graphs
    were ~7% of a trace; peaks checked equal with it on: zero-bubble pp, MoE, cp x tp, selective AC)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["meshforge.simulate.estimate", "meshforge.simulate.sharding"])
    # the server imports torch now, beside the caller's own work before its first submit (the pool
    # starts it at its first worker: ~2 s of `estimate --all-meshes` with one core idle)
    multiprocessing.forkserver.ensure_running()
    workers = workers or max(1, min(4, usable_cores()))
    return TracePool(workers, mp_context=ctx, max_tasks_per_child=1, initializer=gc.disable)


@contextlib.contextmanager
def isolated_sharding_propagation() -> Iterator[None]:
    """DTensor's sharding propagation, kept out of a traced step. To learn an op's output shape,
    DTensor runs the op on fake tensors of the *global* shape; under a trace's FakeTensorMode
    torch runs that in the trace's own mode, below its MemTracker, so the tracker counted
    global-shape tensors no rank holds (llm_1b tp8: 10.78 GiB traced where a rank holds ~4.2).
    Here it runs with the trace's modes set aside, in a fake mode of its own (torch 2.13's private
    `_propagate_tensor_meta_non_cached`, which every propagation reaches under a fake mode: a
    renamed one fails the trace, and tests/plan/test_memory.py's tp test with it)."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached
    aside = FakeTensorMode()  # one for the trace: torch would make one per op (~5 ms each)

    def propagate_aside(self, op_schema):
        with _disable_current_modes(), aside:  # the op runs in `aside`, which no tracker watches
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate_aside
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
