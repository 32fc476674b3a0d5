"""A recipe, loaded and validated against everything it names: the configs' own rules, the
model family's rules on the mesh, the pipeline schedule's, the parallelisms' combinations.

Every problem is reported at once (field, value, fix); -1 fields come back resolved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from meshforge.configs import Problem, Recipe, RecipeError, RecipeLike, ac_policy, checks, read_config
from meshforge.core.errors import IncompatibleWeights, UnsupportedConfig
from meshforge.core.topology import ParallelDims
from meshforge.models import MODELS, args_from_config, family_of_hf, get_model_spec, unknown_overrides
from meshforge.models.moe import has_experts
from meshforge.parallelisms.ac import unknown_ops
from meshforge.parallelisms.cp import ATTENTION, shape_problems
from meshforge.parallelisms.ep import check_ep
from meshforge.parallelisms.float8 import check_float8
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.parallelisms.pp import SCHEDULES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, check_pipeline


def load_recipe(
    path_or_name: RecipeLike,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
) -> Recipe:
    """Load, merge and validate a recipe; -1 fields come back resolved for `world_size`.

    Raises RecipeError listing every problem.
    """
    recipe, path, key_problems = read_config(path_or_name, overrides)
    left_out = {p.field for p in key_problems}
    problems = [_left_out(p) if p.field != "override" else p for p in key_problems]
    problems += [p for p in validate(recipe, world_size) if not _names_any(p.field, left_out)]
    if problems:
        raise RecipeError(problems, str(path))
    return recipe


def _left_out(p: Problem) -> Problem:
    """A key problem, saying that the rules across fields ran without the key."""
    return Problem(p.field, p.value, f"{p.message} (the checks across fields left it out)")


def _names_any(field: str, keys: set[str]) -> bool:
    """Is `field` one of `keys` or inside one (`train.seq_len` inside `train`)?"""
    return any(field == k or field.startswith(f"{k}.") for k in keys)


def validate(r: Recipe, world_size: int | None) -> list[Problem]:
    """Every rule; resolves -1 degrees, batch sizes and microbatches in place."""
    mesh_problems = checks.resolve_mesh(r, world_size)
    problems = check_choices(r) + mesh_problems
    dims = ParallelDims.from_config(r.mesh) if not mesh_problems else None
    model_problems, args = resolve_model(r)
    problems += model_problems
    family_problems = []
    if args is not None:
        family_problems = get_model_spec(r.model.name).check(args, dims or ParallelDims())
        mesh_fits = not any(
            p.field.startswith("mesh.") for p in family_problems
        )  # else cp and SP split by it
        problems += family_problems + check_shapes(r, args, dims if mesh_fits else None)
    buildable = None if model_problems or family_problems else args  # float8's check builds it
    if dims is not None:
        batch_problems = checks.resolve_batch(r)
        problems += batch_problems
        if args is not None and not batch_problems:  # the schedule's rules need a resolved batch
            problems += check_pipeline(r.pp, dims.pp, args.n_layers, r.train.micro_batch_size)
        problems += check_combinations(r, dims)
        problems += check_experts(r, args, dims)
    problems += checks.check(r)
    problems += check_op_names(r)
    problems += check_profile(r)
    if args is not None:
        problems += check_hf_init(r, args)
    problems += check_float8(r.float8, r.backend, r.fsdp.param_dtype, r.model.name, buildable)
    return problems


def check_choices(r: Recipe) -> list[Problem]:
    """Choices owned by the registry and the parallelisms: model, flavor, dtypes, schedule."""
    return checks.choice_problems(
        {
            "fsdp.param_dtype": (r.fsdp.param_dtype, tuple(DTYPES)),
            "fsdp.reduce_dtype": (r.fsdp.reduce_dtype, tuple(DTYPES)),
            "pp.schedule": (r.pp.schedule, SCHEDULES),
            "cp.method": (r.cp.method, tuple(ATTENTION)),
            "model.name": (r.model.name, tuple(MODELS)),
        }
    )


def resolve_model(r: Recipe) -> tuple[list[Problem], object | None]:
    """The model's args (None when they cannot be had) and what is wrong with [model]: an
    unknown flavor, an HF folder that is missing, of another family or not understood, an
    override the family has no field for."""
    m = r.model
    if m.name not in MODELS:
        return [], None  # reported by check_choices
    problems = []
    if m.hf is None and m.flavor not in MODELS[m.name].flavors:
        flavors = ", ".join(MODELS[m.name].flavors)
        problems.append(Problem("model.flavor", m.flavor, f"must be one of {flavors}, or set model.hf"))
    if m.hf is not None:
        try:
            family = family_of_hf(m.hf)
        except FileNotFoundError:
            return [Problem("model.hf", m.hf, "no config.json there: point it at an HF model folder")], None
        except IncompatibleWeights as e:  # an unsupported key, or a config.json that is not JSON
            return [Problem("model.hf", m.hf, str(e))], None
        if family != m.name:
            problems.append(
                Problem("model.name", m.name, f"{m.hf} holds a {family} model: set model.name={family}")
            )
    for key in unknown_overrides(m):
        problems.append(
            Problem(
                f"model.{key}",
                getattr(m, key),
                f"{m.name} has no {key}; remove it (fields of {m.name}: see `meshforge explain model`)",
            )
        )
    if problems:
        return problems, None
    try:
        return [], args_from_config(m)
    except UnsupportedConfig as e:
        return [Problem("model.hf", m.hf, str(e))], None


def check_shapes(r: Recipe, args, dims: ParallelDims | None) -> list[Problem]:
    """The sequence against the model (RoPE table, sequence parallel) and the tokenizer."""
    problems = []
    if r.train.seq_len > args.max_seq_len:
        problems.append(
            Problem(
                "train.seq_len",
                r.train.seq_len,
                f"exceeds model max_seq_len={args.max_seq_len}; lower it or raise model.max_seq_len",
            )
        )
    if r.data.tokenizer == "byte" and r.data.source != "synthetic" and args.vocab_size < 258:
        problems.append(
            Problem(
                "model.vocab_size",
                args.vocab_size,
                "the byte tokenizer (with BOS/EOS) needs vocab_size >= 258",
            )
        )
    if dims is not None:
        problems += check_sequence_split(r, args, dims)
    return problems


def check_sequence_split(r: Recipe, args, dims: ParallelDims) -> list[Problem]:
    """What cp and sequence parallel need of the sequence and the heads: cp cuts it in 2 x cp
    equal chunks (and Ulysses hands each cp rank whole heads of a tp rank's), then sequence
    parallel splits each cp rank's part over tp."""
    problems, seq, cp, tp = [], r.train.seq_len, dims.cp, dims.tp
    if dims.cp_enabled and r.cp.method in ATTENTION:
        for rule in shape_problems(seq, args.n_heads // tp, args.kv_heads // tp, cp, r.cp.method):
            if rule.startswith("seq_len"):
                near = seq - seq % (2 * cp) or 2 * cp
                problems.append(Problem("train.seq_len", seq, f"mesh.cp={cp} needs {rule}, e.g. {near}"))
            else:
                heads = math.gcd(args.n_heads // tp, args.kv_heads // tp)
                valid = [d for d in range(2, heads + 1) if heads % d == 0] or "none"
                fix = f"mesh.cp among {valid} (with tp={tp}), or cp.method=allgather"
                problems.append(Problem("cp.method", r.cp.method, f"{rule}: use {fix}"))
    local = seq // cp
    if dims.tp_enabled and r.tp.sequence_parallel and not problems and local % tp:
        step = math.lcm(2 * cp, cp * tp) if dims.cp_enabled else tp  # cp's chunks, then SP's split
        what = f"each cp rank's {local} tokens" if dims.cp_enabled else "the sequence"
        multiple = f"lcm(2 x cp, cp x tp) = {step}" if dims.cp_enabled else str(tp)
        problems.append(
            Problem(
                "train.seq_len",
                seq,
                f"sequence parallel shards {what} over tp={tp}: use a multiple of {multiple}, e.g. "
                f"{seq - seq % step or step}, or tp.sequence_parallel=false",
            )
        )
    return problems


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


def experts_of(r: Recipe) -> int:
    """The experts per sparse layer of the recipe's model (0: a dense model, or one not resolved):
    sweeps and estimates cross every mesh with the ep degrees they allow."""
    try:
        args = args_from_config(r.model)
    except (KeyError, UnsupportedConfig, FileNotFoundError, IncompatibleWeights):
        return 0
    return args.num_experts if has_experts(args) else 0


def check_experts(r: Recipe, args, dims: ParallelDims) -> list[Problem]:
    """Expert parallel's rules (parallelisms/ep.py); MoE is dropless, torch-only, and a balancing
    setting the chosen balancing does not read is refused."""
    m, problems = (
        r.model,
        check_ep(dims, args, ac_policy(r.activation_checkpoint)) if args is not None else [],
    )
    if m.capacity_factor is not None:
        problems.append(
            Problem(
                "model.capacity_factor",
                m.capacity_factor,
                "meshforge's MoE is dropless (every token reaches its top-k experts, none is dropped at "
                "a capacity); remove it",
            )
        )
    if args is None or not has_experts(args):
        return problems
    if r.backend == "jax":
        problems.append(
            Problem("backend", "jax", "mixture-of-experts training is torch-only for now: backend=torch")
        )
    unread = {
        "aux_free": ("router_aux_loss_coef", "has no loss term"),
        "aux_loss": ("bias_update_rate", "moves no bias"),
    }
    name, why = unread.get(args.load_balance, (None, ""))
    if name is not None and getattr(m, name) is not None:
        problems.append(
            Problem(
                f"model.{name}",
                getattr(m, name),
                f"is not read: load_balance = {args.load_balance!r} {why}; remove it or change "
                "model.load_balance",
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


def check_hf_init(r: Recipe, args) -> list[Problem]:
    """An HF folder to start from must exist and hold the recipe's model."""
    folder = r.checkpoint.init_from_hf
    if not folder or r.checkpoint.init_from:
        return []
    try:
        diff = get_model_spec(r.model.name).hf_mismatch(Path(folder), args)
    except FileNotFoundError:
        return [
            Problem(
                "checkpoint.init_from_hf",
                folder,
                "no config.json there: point it at an HF Llama folder (config.json + *.safetensors)",
            )
        ]
    except IncompatibleWeights as e:  # an unsupported key, or a config.json that is not JSON
        return [Problem("checkpoint.init_from_hf", folder, str(e))]
    if diff:
        return [
            Problem(
                "checkpoint.init_from_hf",
                folder,
                "its model differs from the recipe's (" + "; ".join(diff) + "): use the checkpoint's "
                "model.flavor or set model.* to its config.json",
            )
        ]
    return []
