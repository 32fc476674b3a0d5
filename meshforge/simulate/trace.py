"""One rank's training step traced on fake tensors: its peak memory by category, and each
phase's (every forward and backward of the rank's schedule, the gradient reduction, the step's
own collectives before its update, a logged step's gather of the memory figures, the optimizer
step). What `meshforge estimate` runs per role
(estimate.py); see its module doc."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import _disable_current_modes

from meshforge.configs import Recipe, ac_policy
from meshforge.core.tensors import local_tensor
from meshforge.core.topology import ParallelDims
from meshforge.models import args_from_config
from meshforge.models.common.moe import has_experts
from meshforge.parallelisms import to_empty
from meshforge.parallelisms.ac import checkpointed_blocks
from meshforge.parallelisms.cp import forget_cached_tensors
from meshforge.parallelisms.fsdp import DTYPES, fsdp_applies, fsdp_units, quiet_embedding_view_warning
from meshforge.parallelisms.pp import build_schedule
from meshforge.parallelisms.pp_actions import parse_action, pipeline_order
from meshforge.parallelisms.tied import tie_across_stages
from meshforge.run.observe.memory import LOGGED_FIGURES
from meshforge.run.observe.memtrace import CATEGORIES, make_tracker, peak_categories, phase_peak_categories
from meshforge.run.optimizers import steady_state
from meshforge.run.rank.distributed import pick_device_type
from meshforge.run.train.optim import build_optimizer
from meshforge.run.train.step import StepPolicy, clip_grad_norm, cross_entropy_sum
from meshforge.simulate.fake_rank import isolated_sharding_propagation, simulated_rank
from meshforge.simulate.op_costs import CostRecorder, tensor_bytes


def trace_rank(recipe: Recipe, rank: int, work: bool = True) -> dict:
    """Rank `rank`'s peak memory by category, traced on fake tensors (see module doc), under
    `phases` each place's own peak by category (block_locator), and with `work` under `work` each
    phase's work (op_costs.CostRecorder: a fifth of the trace's time, which memory alone skips).
    Run it in a fresh process (trace_pool), or after traces of the same rank and mesh only
    (trace_depths): torch caches plans by mesh layout across traces."""
    with (
        simulated_rank(recipe, rank) as (dims, meshes, pmodel),
        FakeTensorMode(allow_non_fake_inputs=True),
        isolated_sharding_propagation(),
    ):
        for part in pmodel.parts:
            to_empty(part, "cpu")  # no weight init: values do not matter (and trunc_normal_ fails here)
            part.init_buffers(torch.device("cpu"))
            part.train()
        # for-loop: foreach AdamW's batched temporaries would be counted all at once under fake tensors
        optimizers = [
            build_optimizer(part.named_parameters(), recipe.optimizer, implementation="for-loop")
            for part in pmodel.parts
        ]
        actions, stages = _rank_actions(recipe, dims, meshes, pmodel, rank)
        with _disable_current_modes():  # its groups come from the mesh's rank table, a real tensor
            tied = tie_across_stages(
                pmodel.parts, pmodel.stage_ids, meshes.root, recipe.pp, torch.device("cpu")
            )
        _allocate_moments(optimizers)  # steady state: as on step 2 of a run
        offloaded = _sharded_states(pmodel.parts, optimizers)  # before a step leaves params unsharded
        tracker = make_tracker(pmodel.parts, optimizers)
        ac = ac_policy(recipe.activation_checkpoint)
        tracker.locate = block_locator(pmodel.parts, ac.period)
        # above the tracker, which hands DTensor ops on unseen: the recorder counts them, then
        # their local ops come back through both
        recorder = CostRecorder(lambda: tracker.phase) if work else contextlib.nullcontext()
        with (
            tracker,
            recorder,
            StepPolicy.of(dims, recipe.tp, recipe.fsdp).context("cpu"),
            quiet_embedding_view_warning(),
        ):
            _run_actions(recipe, dims, pmodel, actions, tracker)
            if work:
                _count_hooked_units(recorder, pmodel, actions, ac)
            tracker.phase = "reduce"
            for stage in stages:
                stage.perform_reduce_grad(1)  # the schedule's final gradient reduction (FSDP)
            tracker.phase = "sync"
            _step_collectives(dims, meshes, pmodel.parts, tied, args_from_config(recipe.model))
            tracker.phase = "log"
            _logging_collectives(pick_device_type(recipe.train.device), dims.world_size)
            tracker.phase = "optimizer"
            if work:
                recorder.paused = True  # the memory of a for-loop step; priced as the run steps below
            for opt in optimizers:
                _step_once_per_shape(opt)
        if work:  # outside the tracker: this optimizer's state is no memory of the run's
            _price_the_runs_optimizer(optimizers, recipe, recorder)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        on_device = (lambda c: off_the_device(c, offloaded)) if recipe.fsdp.cpu_offload else dict
        phases = {p: on_device(c) for p, c in phase_peak_categories(tracker).items()}
        traced = {**on_device(peak_categories(tracker)), "phases": phases}
        if work:
            shape, dtype = stage_boundary(recipe, dims)
            traced["work"] = {
                "costs": recorder.result(),
                "actions": actions,
                "boundary_bytes": shape[0] * shape[1] * shape[2] * dtype.itemsize,
                "log_every": recipe.logging.log_every,  # the "log" phase runs on one step in this many
            }
        return traced


def _step_collectives(dims: ParallelDims, meshes, parts: list, tied, args) -> None:
    """What trainer._step runs around its clipping, collectives the step waits on: the token count
    over dp (before the forwards in a run: here, where the step model prices it alike), a weight
    tied across pipeline stages summing its gradient's copies, the gradient norm (each mesh's
    partial norms, a float per parameter, then across stages) and the loss, stop flag and MoE
    statistics over every rank. Small, but each blocks: a group of 8's took ~15 ms on 8 ranks
    sharing 2 cores (tune --calibrate). Clipping's multiply is not traced (max_norm 0: no host
    read of the fake norm)."""
    if dims.dp > 1:
        dist.all_reduce(torch.zeros(()), group=meshes.dp.get_group())
    tied.sync_grads()
    params = [p for part in parts for p in part.parameters()]
    pp_group = meshes.pp.get_group() if dims.pp_enabled else None
    clip_grad_norm(params, 0.0, pp_group, skip=tied.norm_skips())
    moe_floats = args.n_layers * (args.num_experts + 2) if has_experts(args) else 0
    dist.all_reduce(torch.zeros(2 + moe_floats))


def _logging_collectives(device_type: str, world: int) -> None:
    """What a logged step adds (lifecycle._metrics, every logging.log_every steps): every rank's
    memory figures gathered over the world (memory.gather_across_ranks, a float64 each). Traced
    as one all-gather into a tensor: the same kind and bytes as the trainer's list form. Small,
    but it blocks: on 8 ranks sharing 2 cores, logging every step made debug_cpu's step ~20 ms
    longer (0.182 s against 0.164 logging every 12th; dprep8: 0.225, 0.204)."""
    figures = torch.zeros(LOGGED_FIGURES[device_type], dtype=torch.float64)
    dist.all_gather_single(torch.empty(world * figures.numel(), dtype=torch.float64), figures)


def trace_depths(recipes: list[Recipe], rank: int, work: bool = True) -> list[dict]:
    """`trace_rank` of one rank for recipes that differ only in depth, one after another in one
    process: the same rank of the same mesh, so what torch cached in the first (fake-tensor
    dispatch, DTensor sharding plans) holds for the next, which runs ~30% faster. (Different
    ranks cannot share a process: torch's cached plans name the first rank's process groups.)"""
    traces = []
    for recipe in recipes:
        forget_cached_tensors()  # one cached by the last trace would go uncounted in this one
        traces.append(trace_rank(recipe, rank, work))
    return traces


def _price_the_runs_optimizer(traced: list, recipe: Recipe, recorder: CostRecorder) -> None:
    """One step of the optimizer the run builds over the parameters the traced ones step, counted
    by `recorder` (fused AdamW: one kernel over every parameter, where the for-loop step traced
    for the memory dispatches ~12 ops per parameter: ~0.24 s of an H100 host's time on llm_8b at
    dp8-tp2, against the device's 15 ms). Its fallback is the run's to log, not each trace's."""
    named = [[(opt.names[id(p)], p) for group in opt.param_groups for p in group["params"]] for opt in traced]
    optimizers = [build_optimizer(ps, recipe.optimizer, quiet=True) for ps in named]
    _allocate_moments(optimizers)  # as the run's step 2 finds them, uncounted
    recorder.paused = False
    with recorder, torch.no_grad():
        for opt in optimizers:
            opt.step()


def _step_once_per_shape(opt: torch.optim.Optimizer) -> None:
    """The optimizer step on one parameter of each distinct shape and sharding, for the step's
    memory (its work is priced on the run's optimizer: _price_the_runs_optimizer): stepping every
    parameter was ~12% of a trace's time (llm_8b, 8 blocks, FSDP x TP). The memory is the full
    step's: the traced (for-loop) AdamW frees each parameter's temporaries by the next one's,
    except its `denom`, alive until the next parameter's is computed, so each representative
    steps beside a buffer the size of the largest parameter stepped just before one like it (made
    in the step, so labelled as its state is)."""
    saved = [group["params"] for group in opt.param_groups]
    alike: dict[tuple, list[torch.Tensor]] = {}
    before: dict[tuple, torch.Tensor] = {}  # key -> the largest local tensor stepped just before one
    with torch.no_grad():
        for i, params in enumerate(saved):
            previous = None
            for p in (p for p in params if p.grad is not None):  # AdamW skips the others
                local = local_tensor(p)
                sharding = [
                    (getattr(t, "device_mesh", None), getattr(t, "placements", None)) for t in (p, p.grad)
                ]
                key = (i, p.shape, p.dtype, p.grad.dtype, local.shape, local.stride(), *sharding)
                alike.setdefault(key, []).append(p)
                if previous is not None and (
                    key not in before or tensor_bytes(previous) > tensor_bytes(before[key])
                ):
                    before[key] = previous
                previous = local
    held = {}

    def hold(*_) -> None:
        if held["key"] in before:
            held["buffer"] = torch.empty_like(before[held["key"]])

    hooks = [
        opt.register_step_pre_hook(hold),
        opt.register_step_post_hook(lambda *_: held.pop("buffer", None)),
    ]
    try:
        for key, same in alike.items():
            for j, g in enumerate(opt.param_groups):
                g["params"] = [same[0]] if j == key[0] else []
            held["key"] = key
            opt.step()
    finally:
        for hook in hooks:
            hook.remove()
        for g, params in zip(opt.param_groups, saved):
            g["params"] = params


def _sharded_states(parts: list, optimizers: list) -> dict[str, int]:
    """This rank's sharded parameters, their gradients (each its parameter's size) and optimizer
    state, in bytes: what FSDP's CPU offload keeps on the host."""

    def local_bytes(tensors) -> int:
        return sum(tensor_bytes(local_tensor(t)) for t in tensors)

    params = local_bytes(p for part in parts for p in part.parameters())
    moments = local_bytes(
        v
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)  # the moments and AdamW's step counters
    )
    return {"parameters": params, "gradients": params, "optimizer": moments}


def off_the_device(peak: dict[str, int], offloaded: dict[str, int]) -> dict:
    """The traced peak with the offloaded states moved off the device: each category loses
    what is on the host (at most what it held at the peak), `host` says how much that is, and
    `total` is the device's."""
    out = {c: max(0, peak[c] - offloaded.get(c, 0)) for c in CATEGORIES}
    return {**out, "total": sum(out.values()), "host": sum(offloaded.values())}


def _rank_actions(recipe: Recipe, dims, meshes, pmodel, rank: int) -> tuple[list[tuple[int, str, int]], list]:
    """(stage, 'F'|'B'|'I'|'W', microbatch) in the order this rank runs them, and the torch
    pipeline stages (for their final gradient reduction; none without pipelining)."""
    if not dims.pp_enabled:  # microbatches one after another; the second backward finds every grad allocated
        return [(0, kind, m) for m in range(min(recipe.train.grad_accum_steps, 2)) for kind in "FB"], []
    schedule = build_schedule(
        pmodel.parts, pmodel.stage_ids, meshes.pp, recipe.pp, torch.device("cpu"), lambda x, y: x
    )
    mine = pipeline_order(schedule)[dims.coordinate(rank)["pp"]]
    stages = getattr(schedule, "_stages", None) or [schedule._stage]  # torch keeps a list, or one
    return [a for a in map(parse_action, mine) if a is not None], stages


def _count_hooked_units(recorder: CostRecorder, pmodel, actions: list[tuple[int, str, int]], ac) -> None:
    """Each forward and backward of a stage runs, once each, the hooks of every FSDP unit in it
    (its blocks, embeddings, norm + output, the stage's root, an MoE block's experts) and those of
    every block it checkpoints (`ac`: the saved tensors' pack and unpack, the recompute's set-up):
    their host work, priced per unit and per block."""
    units = {stage: fsdp_units(part) for stage, part in zip(pmodel.stage_ids, pmodel.parts)}
    blocks = {stage: checkpointed_blocks(part, ac) for stage, part in zip(pmodel.stage_ids, pmodel.parts)}
    for i, (stage, kind, _) in enumerate(actions):
        if kind in "FBI" and (units[stage] or blocks[stage]):  # W: hooked with its input half (I)
            phase = recorder.phases[f"{i}:{kind}{stage}"]
            phase.fsdp_units += units[stage]
            phase.checkpointed_blocks += blocks[stage]


def _allocate_moments(optimizers: list[torch.optim.Optimizer]) -> None:
    """The optimizer's state as its first step creates it (AdamW: a step counter and two moments
    shaped like each parameter; SGD, Lion: one; Muon: one per matrix), so the traced step is a
    steady-state one. Made directly: running a step on zero gradients cost ~1.3 s per 8B trace
    under fake DTensors; a changed state layout fails the traced step loudly (the step reads these keys)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p] = steady_state(opt, group, p)


def stage_boundary(recipe: Recipe, dims) -> tuple[tuple[int, int, int], torch.dtype]:
    """The shape and dtype of what a pipeline stage sends the next (a microbatch's hidden states:
    this rank's part of the sequence under cp, and of that under sequence parallel)."""
    r = recipe
    mb = r.train.micro_batch_size // (r.pp.microbatches if dims.pp_enabled else 1)
    tokens = r.train.seq_len // dims.cp
    sp = dims.tp_enabled and r.tp.sequence_parallel
    dtype = DTYPES[r.fsdp.param_dtype] if fsdp_applies(dims, r.fsdp) else torch.float32
    return (mb, tokens // dims.tp if sp else tokens, args_from_config(r.model).dim), dtype


def _run_actions(recipe: Recipe, dims, pmodel, actions: list[tuple[int, str, int]], tracker) -> None:
    """Forwards and backwards in the given order, each forward's output kept until its backward;
    each action a phase of the tracker (its index: the same actions at every depth)."""
    r, args = recipe, args_from_config(recipe.model)
    last_stage = dims.pp * r.pp.stages_per_rank - 1
    boundary, act_dtype = stage_boundary(recipe, dims)
    mb, tokens = boundary[0], r.train.seq_len // dims.cp  # this rank's part of every sequence under cp
    parts = dict(zip(pmodel.stage_ids, pmodel.parts))
    live: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output awaiting its backward
    for i, (stage, kind, m) in enumerate(actions):
        tracker.phase = f"{i}:{kind}{stage}"
        part = parts[stage]
        if kind == "F":
            x = (
                torch.randint(0, args.vocab_size, (mb, tokens))
                if stage == 0
                else torch.empty(boundary, dtype=act_dtype, requires_grad=True)
            )
            out = part(x)
            if stage == last_stage:
                out = cross_entropy_sum(out, torch.randint(0, args.vocab_size, (mb, tokens)))
            live[(stage, m)] = out
        elif kind in "BI":  # a zero-bubble input-gradient half counted as the whole backward
            if dims.pp_enabled and isinstance(part, FSDPModule):
                # as torch's PipelineStage runs FSDP: no reduce-scatter and no reshard until the
                # step's last backward, so unsharded params and grads live across microbatches
                part.set_is_last_backward(False)
                part.set_reshard_after_backward(False)
                part.set_requires_gradient_sync(False)
            out = live.pop((stage, m))
            out.backward(None if out.dim() == 0 else torch.empty_like(out))
            del out


TOP_LEVEL = ("tok_embeddings", "norm", "output")
# The first 2 periods of a stage's blocks labelled from its start ('0', '1'), the rest from its
# end ('-2', '-1'): FSDP's prefetch makes the first and the last two blocks differ from the steady
# ones between (qwen3_30b_a3b's step peaks at the second block's backward, which prefetches the
# first's); a period is 1 block, or selective AC's `selective_every` (blocks alternate). A shallow
# trace needs 2 x FROM_START_PERIODS periods for every label to mean the same block at both depths
# (estimate.MIN_SHALLOW_PERIODS).
FROM_START_PERIODS = 2


def block_locator(parts: list, period: int) -> Callable[[str, set[str], bool], str]:
    """Where a step is, as a label that means the same place at every depth: 'F'/'B', then a
    block counted from the stage's start or end (FROM_START_PERIODS), a top-level module, or
    the rest of the phase before its first block ('top<') or after one ('top>': a backward's
    gradient reduction, a forward's loss). Memory at each such place grows linearly with the
    depth, so each place's peak extrapolates exactly; the step's peak moves between places as
    a model deepens (a shallow qwen3_30b_a3b peaks at the head's backward, all 48 layers at the
    second block's)."""
    blocks = {key: (i, len(part.layers)) for part in parts for i, key in enumerate(part.layers)}
    seen = {"phase": None, "block": False}  # has the current phase run a block yet

    def locate(phase: str, modules: set[str], backward: bool) -> str:
        if phase != seen["phase"]:
            seen.update(phase=phase, block=False)
        where = [
            blocks[k] for m in modules if ".layers." in m and (k := m.rpartition(".layers.")[2]) in blocks
        ]
        if where:
            seen["block"] = True
            i, n = min(where)
            place = str(i if i < FROM_START_PERIODS * period else i - n)
        else:
            top = "top>" if seen["block"] else "top<"
            names = {m.rpartition(".")[2] for m in modules}
            place = next(
                (n for n in TOP_LEVEL if n in names), top
            )  # in a fixed order: the same in every trace
        return ("B" if backward else "F") + place

    return locate
