"""The rules across sections: combinations of parallelisms and settings measured wrong on
torch 2.13 (refused, with the reason), the profiler's steps, per-op AC's op names."""

from __future__ import annotations

from meshforge.configs import Problem, Recipe, ac_policy
from meshforge.core.topology import ParallelDims
from meshforge.parallelisms.ac import unknown_ops
from meshforge.parallelisms.pp import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES


def check_combinations(r: Recipe, dims: ParallelDims) -> list[Problem]:
    """Combinations measured wrong on torch 2.13 (CPU/gloo): refused, with the reason."""
    problems = []
    zero_bubble = r.mesh.pp > 1 and r.pp.schedule in ZERO_BUBBLE_SCHEDULES
    if zero_bubble and dims.fsdp_shard > 1 and r.fsdp.reshard_after_forward:
        problems.append(
            Problem(
                "fsdp.reshard_after_forward",
                True,
                f"{r.pp.schedule} with FSDP resharding after forward gives wrong gradients on torch "
                "2.13; set fsdp.reshard_after_forward=false or use 1F1B/Interleaved1F1B",
            )
        )
    if r.fsdp.reduce_dtype == "float16" and r.fsdp.param_dtype != "float16":
        problems.append(
            Problem(
                "fsdp.reduce_dtype",
                "float16",
                f"float16 reductions of unscaled gradients underflow; only fsdp.param_dtype=float16 runs "
                f"a loss scale (now {r.fsdp.param_dtype}): set reduce_dtype=float32 or param_dtype=float16",
            )
        )
    if r.eval.every and r.mesh.pp > 1 and r.pp.schedule in V_SCHEDULES:
        problems.append(
            Problem(
                "eval.every",
                r.eval.every,
                f"{r.pp.schedule}'s forward-only pass fails on torch 2.13 (it splits a backward it does "
                "not have); set eval.every=0 or use 1F1B, Interleaved1F1B or InterleavedZeroBubble",
            )
        )
    if ac_policy(r.activation_checkpoint).by_compiler and not r.compile.enabled:
        problems.append(
            Problem(
                "activation_checkpoint.mode",
                "memory_budget",
                "the budget is torch.compile's: its partitioner chooses what a compiled block recomputes; "
                "set compile.enabled=true, or mode=op / full for eager checkpointing",
            )
        )
    if r.compile.enabled and r.mesh.tp > 1:
        problems.append(
            Problem(
                "compile.enabled",
                True,
                "torch.compile with tensor parallel loses the tok_embeddings gradient on torch 2.13; "
                "set compile.enabled=false or mesh.tp=1",
            )
        )
    return problems


def check_profile(r: Recipe) -> list[Problem]:
    """Profiled steps that exist, apart from the memory step, where a profiler can be had."""
    p, problems = r.profile, []
    if p.start_step < 0 or p.steps < 1:
        problems.append(
            Problem("profile", f"start_step={p.start_step}, steps={p.steps}", "start_step >= 0, steps >= 1")
        )
    if not p.start_step or problems:
        return problems
    last = p.start_step + p.steps - 1
    if last > r.train.steps:
        problems.append(
            Problem(
                "profile.start_step",
                p.start_step,
                f"steps {p.start_step}-{last} end after train.steps={r.train.steps}",
            )
        )
    if p.start_step <= r.logging.memory_breakdown_step <= last:
        problems.append(
            Problem(
                "profile.start_step",
                p.start_step,
                f"the profiled steps hold logging.memory_breakdown_step={r.logging.memory_breakdown_step} "
                "(its tracker would be in the trace): profile other steps, or move or 0 the memory step",
            )
        )
    if p.memory_snapshot and r.train.device == "cpu":
        problems.append(
            Problem("profile.memory_snapshot", True, "a CUDA allocator snapshot: not on train.device=cpu")
        )
    if r.backend == "jax":
        problems.append(
            Problem("profile.start_step", p.start_step, "torch.profiler profiles backend=torch runs")
        )
    return problems


def check_op_names(r: Recipe) -> list[Problem]:
    """Per-op AC names ops by namespace.name: one torch does not have is refused, not skipped."""
    ac = r.activation_checkpoint
    unknown = unknown_ops(ac.op_save) if ac_policy(ac).per_op else []
    return (
        [
            Problem(
                "activation_checkpoint.op_save",
                unknown,
                "not ops of this torch: name each as namespace.name, e.g. aten.mm or "
                "_c10d_functional.reduce_scatter_tensor",
            )
        ]
        if unknown
        else []
    )
