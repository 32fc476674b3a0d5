"""The rules on the recipe's model: its family and flavor (or HF folder), the sequence against
the model and the mesh (cp's chunks and heads, sequence parallel's split), expert parallel and
MoE's settings, an HF folder to start from."""

from __future__ import annotations

import math
from pathlib import Path

from meshforge.configs import Problem, Recipe, ac_policy
from meshforge.core.errors import IncompatibleWeights, UnsupportedConfig
from meshforge.core.topology import ParallelDims
from meshforge.models import MODELS, args_from_config, family_of_hf, get_model_spec, unknown_overrides
from meshforge.models.common.moe import Balancing, has_experts
from meshforge.parallelisms.cp import ATTENTION, shape_problems
from meshforge.parallelisms.ep import check_ep


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
    name, why = Balancing(args.load_balance).unread_setting() or (None, "")
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
