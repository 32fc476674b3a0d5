"""What `meshforge tune` says its prediction leaves out: the axes it cannot rank (refused, with
the reason), and the lines under its table where the recipe or a point asks what the traced eager
step does not price (compile, a memory budget, float8, CPU offload, per-op AC's policy, an MoE
block's checkpointing hooks) or where the points train on different batches."""

from __future__ import annotations

from collections.abc import Sequence

from meshforge.configs import ACPolicy, Problem, Recipe, RecipeError, ac_policy
from meshforge.experiments.grid import Point
from meshforge.recipe import experts_of

# What the traced step cannot tell apart, so tune cannot rank it (an axis key, or a key's prefix
# ending in '.'): compile's fused kernels are not traced (the trace runs eager), a memory budget is
# the compiler's partitioner, float8's kernels and CPU offload's host work are not priced (one
# H200, gpu_check.md: llm_1b float8 predicted 59% slower than bf16, ran 5.9% slower (rowwise) to 9.5%
# faster (tensorwise) compiled; with offload predicted 0.19 s, ran 1.28 s)
UNTRACED = {
    "compile.enabled": "the trace runs eager: compiled kernels' time is not modelled",
    "activation_checkpoint.memory_budget": "the compiler's partitioner decides what is saved; not traced",
    "float8.": "float8's matmuls and scaling are priced as eager ops, not as float8 kernels",
    "fsdp.cpu_offload": "the host's optimizer step and the copies to and from it are not modelled",
}
AC_MODE = "activation_checkpoint.mode"


def untraced_reason(key: str, values: list[str]) -> str | None:
    """Why tune cannot rank an axis over `key` (None: it can)."""
    if key == AC_MODE and any(ACPolicy(v).by_compiler for v in values):  # the partitioner's, as above
        return UNTRACED["activation_checkpoint.memory_budget"]
    return next(
        (why for k, why in UNTRACED.items() if key == k or (k.endswith(".") and key.startswith(k))), None
    )


def refuse_untraced(axes: dict[str, list[str]]) -> None:
    """Refuse the axes tune cannot rank, each with why and the way round (a sweep runs them)."""
    if bad := {k: why for k, v in axes.items() if (why := untraced_reason(k, v))}:
        raise RecipeError(
            [
                Problem(f"--axis {k}", axes[k], f"tune cannot rank it: {why}; sweep it instead")
                for k, why in bad.items()
            ],
            "tune",
            "command",
        )


def batch_caveat(ranked: list[dict]) -> str | None:
    """A line when the points train on different global batches: then a shorter step is not a
    faster layout, and the table's order (tokens/s) differs from its step column's."""
    sizes = {r["predicted"]["tokens_per_step"] for r in ranked}
    if len(sizes) < 2:
        return None
    return (
        f"the points train on {min(sizes):,} to {max(sizes):,} tokens per step (e.g. "
        "train.micro_batch_size x grad_accum_steps x the data-parallel degree): ranked by tokens/s, "
        "not step time; set train.global_batch_size to hold the batch fixed across layouts"
    )


def ac_modes(base: Recipe, points: Sequence[Point]) -> set[str]:
    """The activation-checkpointing modes a tune's points run: each point's own, else the recipe's
    (the recipe's alone when there are no points)."""
    own = base.activation_checkpoint.mode
    return {p.policy.get(AC_MODE, own) for p in points} or {own}


def checkpoints(base: Recipe, points: Sequence[Point]) -> bool:
    """Whether a point of the tune checkpoints blocks (apply_ac wraps them)."""
    return any(ACPolicy(mode).wraps_blocks for mode in ac_modes(base, points))


def untraced_caveats(
    recipe: Recipe, points: Sequence[Point] = (), block_hooks_priced: bool = True
) -> list[str]:
    """Lines for what the recipe (or a point's AC mode) asks that the trace does not price: its
    predicted step times are then the eager step's (a compiled step is faster; a memory budget's
    recompute is left out; float8 and CPU offload are not modelled; per-op AC's policy and, where
    the profile prices checkpointing's hooks (`block_hooks_priced`), an MoE block's are priced short)."""
    lines = []
    if recipe.compile.enabled:
        lines.append(
            "compile.enabled = true: each step is predicted as eager (compiled kernels' fusion is not "
            "modelled): a compiled run's step is shorter than its row"
        )
    if ac_policy(recipe.activation_checkpoint).by_compiler:
        lines.append(
            "activation_checkpoint.mode = memory_budget: predicted as no AC (the compiler's partitioner "
            "chooses the recompute): its recompute is not in the step, and the peak is an upper bound"
        )
    if any(ACPolicy(mode).per_op for mode in ac_modes(recipe, points)):
        lines.append(
            "activation_checkpoint.mode = op: priced as full AC's hooks per block; its per-op policy "
            "(Python on every op of the forward and the recompute) is not: its step is longer than its row"
        )
    if block_hooks_priced and experts_of(recipe) and checkpoints(recipe, points):
        # a tiny Qwen3 MoE block's hooks read 1.3-1.9x the same dims' dense block's (on 2 CPU cores)
        lines.append(
            "checkpointed MoE blocks: their hooks are priced at a dense block's (checkpoint_overhead_s, "
            "probed on a dense Llama); an MoE block saves more tensors (its router's and experts') and "
            "its hooks cost more: a checkpointing point's step is longer than its row"
        )
    for key, on in (("float8.enabled", recipe.float8.enabled), ("fsdp.cpu_offload", recipe.fsdp.cpu_offload)):
        if on:
            lines.append(f"{key} = true: step times are not to be trusted: {untraced_reason(key, [])}")
    return lines
