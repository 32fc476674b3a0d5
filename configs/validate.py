"""Cross-field validation: every rule checked, every violation reported at once.

Each Problem names the field, the bad value and a fix (the nearest valid values where
there are some). `resolve_and_validate` also fills in the -1 ("derive it") fields.
"""

from __future__ import annotations

import math

from .loader import Problem
from .schema import Recipe

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# schedules that split backward into input- and weight-gradient passes
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES + V_SCHEDULES
DTYPES = ("float32", "bfloat16")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(value: int, valid: list[int], k: int = 2) -> str:
    best = sorted(valid, key=lambda v: (abs(v - value), v))[:k]
    return ", ".join(str(v) for v in sorted(best))


def mesh_world_size(recipe: Recipe) -> int | None:
    """The world size the mesh spells out, or None if a degree is -1."""
    m = recipe.mesh
    degrees = [m.dp_replicate, m.dp_shard, m.tp, m.pp]
    return None if -1 in degrees else math.prod(degrees)


def resolve_and_validate(recipe: Recipe, world_size: int | None) -> list[Problem]:
    """Check every rule; resolve -1 degrees and batch sizes in place. Returns the problems."""
    problems: list[Problem] = []
    problems += _check_enums(recipe)
    problems += _resolve_mesh(recipe, world_size)
    mesh_ok = not any(p.field.startswith("mesh") for p in problems)
    problems += _check_model(recipe, check_tp=mesh_ok)
    if mesh_ok:
        problems += _resolve_batch(recipe)
        problems += _check_pipeline(recipe)
        problems += _check_combinations(recipe)
    problems += _check_ranges(recipe)
    problems += _check_data(recipe)
    problems += _check_init(recipe)
    return problems


def _check_enums(r: Recipe) -> list[Problem]:
    choices = {
        "train.device": (r.train.device, ("auto", "cpu", "cuda")),
        "lr_scheduler.decay": (r.lr_scheduler.decay, ("cosine", "linear", "constant")),
        "activation_checkpoint.mode": (r.activation_checkpoint.mode, ("none", "full", "selective")),
        "data.source": (r.data.source, ("synthetic", "text", "hf")),
        "data.hf_format": (r.data.hf_format, ("text", "json", "parquet")),
        "fsdp.param_dtype": (r.fsdp.param_dtype, DTYPES),
        "fsdp.reduce_dtype": (r.fsdp.reduce_dtype, DTYPES),
        "pp.schedule": (r.pp.schedule, SCHEDULES),
        "optimizer.name": (r.optimizer.name, ("adamw",)),
        "model.name": (r.model.name, _model_names()),
        "backend": (r.backend, ("torch", "jax")),
    }
    if r.logging.wandb_mode is not None:
        choices["logging.wandb_mode"] = (r.logging.wandb_mode, ("online", "offline", "disabled"))
    problems = []
    for name, (value, valid) in choices.items():
        if value not in valid:
            extra = ""
            if name.startswith("fsdp.") and value == "float16":
                extra = " (fp16 needs a sharded gradient scaler, not supported yet: use bfloat16)"
            problems.append(Problem(name, value, f"must be one of {', '.join(valid)}{extra}"))
    if r.model.name in _model_names():
        flavors = list(_flavors(r.model.name))
        if r.model.flavor not in flavors:
            problems.append(Problem("model.flavor", r.model.flavor, f"must be one of {', '.join(flavors)}"))
    return problems


def _model_names() -> tuple[str, ...]:
    from meshforge.models.registry import MODELS

    return tuple(MODELS)


def _flavors(name: str) -> dict:
    from meshforge.models.registry import MODELS

    return MODELS[name].flavors


def _resolve_mesh(r: Recipe, world_size: int | None) -> list[Problem]:
    m = r.mesh
    names = ("dp_replicate", "dp_shard", "tp", "pp")
    degrees = {n: getattr(m, n) for n in names}
    problems = [
        Problem(f"mesh.{n}", d, "must be a positive degree, or -1 for 'the rest'")
        for n, d in degrees.items()
        if d == 0 or d < -1
    ]
    inferred = [n for n, d in degrees.items() if d == -1]
    if len(inferred) > 1:
        problems.append(Problem("mesh", degrees, f"only one degree may be -1, got {', '.join(inferred)}"))
    if problems:
        return problems
    known = math.prod(d for d in degrees.values() if d != -1)
    spelled = ", ".join(f"{n}={d}" for n, d in degrees.items())
    if world_size is None:
        if inferred:
            return [Problem(f"mesh.{inferred[0]}", -1, "needs a world size: run under torchrun, or pass --nproc N")]
        return []
    if inferred:
        if world_size % known:
            return [Problem(f"mesh.{inferred[0]}", -1,
                            f"world size {world_size} is not divisible by the other degrees ({spelled}, "
                            f"product {known}); use a world size that is a multiple of {known}")]
        setattr(m, inferred[0], world_size // known)
    elif known != world_size:
        return [Problem("mesh", spelled,
                        f"dp_replicate*dp_shard*tp*pp = {known} but the world size is {world_size}; "
                        f"set one degree to -1 to take the rest, or run {known} processes")]
    return []


def _resolved_model_args(r: Recipe):
    from meshforge.models.registry import args_from_config

    return args_from_config(r.model)


def _check_model(r: Recipe, check_tp: bool) -> list[Problem]:
    if r.model.name not in _model_names() or r.model.flavor not in _flavors(r.model.name):
        return []
    a = _resolved_model_args(r)
    problems = []
    if a.dim % a.n_heads:
        problems.append(Problem("model.dim", a.dim, f"must be divisible by n_heads={a.n_heads}; "
                                f"nearest valid: {_nearest(a.dim, [a.n_heads * k for k in range(1, a.dim // a.n_heads + 2)])}"))
    if a.n_heads % a.kv_heads:
        problems.append(Problem("model.n_kv_heads", a.kv_heads,
                                f"must divide n_heads={a.n_heads}; valid: {_nearest(a.kv_heads, divisors(a.n_heads))}"))
    if r.train.seq_len > a.max_seq_len:
        problems.append(Problem("train.seq_len", r.train.seq_len,
                                f"exceeds model max_seq_len={a.max_seq_len}; lower it or raise model.max_seq_len"))
    if r.data.tokenizer == "byte" and r.data.source != "synthetic" and a.vocab_size < 256:
        problems.append(Problem("model.vocab_size", a.vocab_size, "the byte tokenizer needs vocab_size >= 256"))
    tp = r.mesh.tp
    if check_tp and tp > 1:
        valid_tp = [d for d in divisors(a.kv_heads) if a.n_heads % d == 0]
        if a.n_heads % tp:
            problems.append(Problem("mesh.tp", tp, f"n_heads={a.n_heads} is not divisible by tp; valid tp: {_nearest(tp, valid_tp)}"))
        if a.kv_heads % tp:
            problems.append(Problem("mesh.tp", tp, f"n_kv_heads={a.kv_heads} is not divisible by tp (each rank needs "
                                    f"whole kv heads, so n_kv_heads >= tp); valid tp: {_nearest(tp, valid_tp)}"))
        if a.ffn_hidden_dim % tp or a.vocab_size % tp:
            problems.append(Problem("mesh.tp", tp, f"FFN hidden {a.ffn_hidden_dim} and vocab {a.vocab_size} must be divisible by tp"))
        if r.tp.sequence_parallel and r.train.seq_len % tp:
            problems.append(Problem("train.seq_len", r.train.seq_len,
                                    f"sequence parallel shards the sequence over tp={tp}: use a multiple of {tp}, "
                                    f"e.g. {r.train.seq_len - r.train.seq_len % tp or tp}, or tp.sequence_parallel=false"))
        if a.tie_embeddings:
            problems.append(Problem("model.tie_embeddings", True,
                                    "tied embeddings with tp > 1 are not supported (embedding and output shard "
                                    "differently); use mesh.tp=1 or model.tie_embeddings=false"))
    if check_tp and r.mesh.pp > 1 and a.tie_embeddings:
        problems.append(Problem("model.tie_embeddings", True,
                                "tied embeddings need embedding and output on one pipeline stage; "
                                "use mesh.pp=1 or model.tie_embeddings=false"))
    return problems


def dp_degree(r: Recipe) -> int:
    return r.mesh.dp_replicate * r.mesh.dp_shard


def _resolve_batch(r: Recipe) -> list[Problem]:
    t, dp = r.train, dp_degree(r)
    g, m, a = t.global_batch_size, t.micro_batch_size, t.grad_accum_steps
    unknown = [n for n, v in (("global_batch_size", g), ("micro_batch_size", m), ("grad_accum_steps", a)) if v == -1]
    bad = [Problem(f"train.{n}", v, "must be positive, or -1 to derive it from the other two")
           for n, v in (("global_batch_size", g), ("micro_batch_size", m), ("grad_accum_steps", a)) if v == 0 or v < -1]
    if bad:
        return bad
    if len(unknown) > 1:
        return [Problem("train", unknown, "set at least two of global_batch_size, micro_batch_size, grad_accum_steps")]
    if g == -1:
        t.global_batch_size = m * a * dp
        return []
    if m == -1 or a == -1:
        known = a if m == -1 else m
        if g % (known * dp):
            name = "micro_batch_size" if m == -1 else "grad_accum_steps"
            valid = [known * dp * k for k in range(1, g // (known * dp) + 2)]
            return [Problem("train.global_batch_size", g,
                            f"must be a multiple of {'grad_accum_steps' if m == -1 else 'micro_batch_size'} x dp "
                            f"= {known * dp} to derive {name}; nearest valid: {_nearest(g, valid)}")]
        setattr(t, "micro_batch_size" if m == -1 else "grad_accum_steps", g // (known * dp))
        return []
    if g != m * a * dp:
        return [Problem("train.global_batch_size", g,
                        f"must equal micro_batch_size x grad_accum_steps x dp = {m} x {a} x {dp} = {m * a * dp}; "
                        f"set it to {m * a * dp}, or set one of the three to -1 to derive it")]
    return []


def pp_stage_count(r: Recipe) -> int:
    return r.mesh.pp * r.pp.stages_per_rank


def _check_pipeline(r: Recipe) -> list[Problem]:
    p, pp = r.pp, r.mesh.pp
    if pp == 1:
        return []
    problems = []
    stages = pp * p.stages_per_rank
    if p.stages_per_rank < 1:
        return [Problem("pp.stages_per_rank", p.stages_per_rank, "must be >= 1")]
    if p.schedule in SINGLE_STAGE_SCHEDULES and p.stages_per_rank != 1:
        problems.append(Problem("pp.stages_per_rank", p.stages_per_rank,
                                f"{p.schedule} runs one stage per rank; set 1, or use Interleaved1F1B for virtual stages"))
    if p.schedule in V_SCHEDULES and p.stages_per_rank != 2:
        problems.append(Problem("pp.stages_per_rank", p.stages_per_rank, f"{p.schedule} is a V schedule: it needs exactly 2 stages per rank"))
    if r.model.name in _model_names() and r.model.flavor in _flavors(r.model.name):
        n_layers = _resolved_model_args(r).n_layers
        if p.layers_per_stage is not None:
            if len(p.layers_per_stage) != stages or sum(p.layers_per_stage) != n_layers or min(p.layers_per_stage) < 0:
                problems.append(Problem("pp.layers_per_stage", p.layers_per_stage,
                                        f"needs {stages} non-negative counts (pp x stages_per_rank) summing to n_layers={n_layers}"))
        elif n_layers < stages:
            problems.append(Problem("mesh.pp", pp, f"{stages} pipeline stages but only {n_layers} layers; "
                                    f"valid pp x stages_per_rank <= {n_layers}"))
    if p.microbatches == -1:
        p.microbatches = stages
    mb, local = p.microbatches, r.train.micro_batch_size
    if mb < 1:
        problems.append(Problem("pp.microbatches", mb, "must be >= 1"))
    elif local % mb:
        problems.append(Problem("pp.microbatches", mb,
                                f"must divide the local batch train.micro_batch_size={local}; valid: {_nearest(mb, divisors(local))}"))
    if p.schedule == "DualPipeV" and mb < stages:
        problems.append(Problem("pp.microbatches", mb, f"DualPipeV needs microbatches >= stages = pp x 2 = {stages}"))
    elif p.schedule in ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble") and mb < pp:
        problems.append(Problem("pp.microbatches", mb, f"{p.schedule} needs microbatches >= pp={pp}"))
    if p.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and mb % pp:
        problems.append(Problem("pp.microbatches", mb, f"{p.schedule} needs a multiple of pp={pp}"))
    return problems


def fsdp_enabled(r: Recipe) -> bool:
    return r.mesh.dp_shard > 1 or r.mesh.dp_replicate > 1


def _check_combinations(r: Recipe) -> list[Problem]:
    """Combinations measured wrong on torch 2.13 (CPU/gloo): refused, with the reason."""
    problems = []
    if r.mesh.pp > 1 and r.pp.schedule in ZERO_BUBBLE_SCHEDULES and r.mesh.dp_shard > 1 and r.fsdp.reshard_after_forward:
        problems.append(Problem("fsdp.reshard_after_forward", True,
                                f"{r.pp.schedule} with FSDP resharding after forward gives wrong gradients on torch 2.13; "
                                "set fsdp.reshard_after_forward=false or use 1F1B/Interleaved1F1B"))
    if r.backend == "jax":
        why = "backend=jax trains data- and tensor-parallel recipes"
        if r.mesh.pp > 1:
            problems.append(Problem("mesh.pp", r.mesh.pp, f"{why}; pipeline parallelism is torch-only: set mesh.pp=1 "
                                                           "(and give its ranks to dp_shard or tp) or backend=torch"))
        if r.fsdp.param_dtype != "float32":
            problems.append(Problem("fsdp.param_dtype", r.fsdp.param_dtype,
                                    f"{why} in float32 for now; set fsdp.param_dtype=float32 or backend=torch"))
        if r.checkpoint.enabled or r.checkpoint.load or r.checkpoint.init_from or r.checkpoint.init_from_hf:
            problems.append(Problem("checkpoint.enabled", r.checkpoint.enabled,
                                    f"{why} without checkpoints for now; export a torch checkpoint with "
                                    "`meshforge export CKPT --to jax`, or set checkpoint.enabled=false"))
    if r.compile.enabled and r.mesh.tp > 1:
        problems.append(Problem("compile.enabled", True,
                                "torch.compile with tensor parallel loses the tok_embeddings gradient on torch 2.13; "
                                "set compile.enabled=false or mesh.tp=1"))
    return problems


def _check_ranges(r: Recipe) -> list[Problem]:
    checks = [
        ("optimizer.lr", r.optimizer.lr, r.optimizer.lr > 0, "must be > 0, e.g. 3e-4"),
        ("optimizer.weight_decay", r.optimizer.weight_decay, r.optimizer.weight_decay >= 0, "must be >= 0"),
        ("optimizer.eps", r.optimizer.eps, r.optimizer.eps > 0, "must be > 0, e.g. 1e-8"),
        ("optimizer.betas", r.optimizer.betas,
         len(r.optimizer.betas) == 2 and all(0 <= b < 1 for b in r.optimizer.betas), "must be two numbers in [0, 1), e.g. [0.9, 0.95]"),
        ("train.steps", r.train.steps, r.train.steps > 0, "must be > 0"),
        ("train.seq_len", r.train.seq_len, r.train.seq_len > 0, "must be > 0"),
        ("train.max_norm", r.train.max_norm, r.train.max_norm >= 0, "must be >= 0 (0 disables clipping)"),
        ("train.cpu_threads", r.train.cpu_threads, r.train.cpu_threads >= 0, "must be >= 0 (0 = automatic)"),
        ("lr_scheduler.warmup_steps", r.lr_scheduler.warmup_steps, 0 <= r.lr_scheduler.warmup_steps, "must be >= 0"),
        ("lr_scheduler.min_lr_ratio", r.lr_scheduler.min_lr_ratio, 0 <= r.lr_scheduler.min_lr_ratio <= 1, "must be in [0, 1]"),
        ("logging.log_every", r.logging.log_every, r.logging.log_every > 0, "must be > 0"),
        ("logging.memory_breakdown_step", r.logging.memory_breakdown_step, r.logging.memory_breakdown_step >= 0,
         "must be >= 0 (0 turns the per-category memory step off)"),
        ("activation_checkpoint.selective_every", r.activation_checkpoint.selective_every,
         r.activation_checkpoint.selective_every > 0, "must be > 0"),
        ("data.markov_branching", r.data.markov_branching, r.data.markov_branching > 0, "must be > 0"),
        ("checkpoint.interval", r.checkpoint.interval, r.checkpoint.interval > 0, "must be > 0"),
        ("checkpoint.keep_latest", r.checkpoint.keep_latest, r.checkpoint.keep_latest >= 0, "must be >= 0 (0 keeps all)"),
        ("train.max_bad_steps", r.train.max_bad_steps, r.train.max_bad_steps >= 0, "must be >= 0"),
    ]
    return [Problem(name, value, fix) for name, value, ok, fix in checks if not ok]


def _check_data(r: Recipe) -> list[Problem]:
    d = r.data
    if d.source == "text" and not d.path:
        return [Problem("data.path", d.path, "data.source='text' needs a glob of local text files, e.g. 'data/*.txt'")]
    if d.source == "hf" and not (d.path or d.hf_dataset):
        return [Problem("data.path", d.path, "data.source='hf' needs data.path (local json/parquet/text files) or data.hf_dataset")]
    return []


def _check_init(r: Recipe) -> list[Problem]:
    """An HF folder to start from must exist and hold the recipe's model."""
    c = r.checkpoint
    if not c.init_from_hf:
        return []
    if c.init_from:
        return [Problem("checkpoint.init_from_hf", c.init_from_hf, "set either checkpoint.init_from or "
                                                                    "checkpoint.init_from_hf, not both")]
    from pathlib import Path

    from meshforge.interop import args_from_hf_config, check_compatible

    config = Path(c.init_from_hf) / "config.json"
    if not config.is_file():
        return [Problem("checkpoint.init_from_hf", c.init_from_hf,
                        "no config.json there: point it at an HF Llama folder (config.json + *.safetensors)")]
    import json

    diff = check_compatible(args_from_hf_config(json.loads(config.read_text())), _resolved_model_args(r))
    if diff:
        return [Problem("checkpoint.init_from_hf", c.init_from_hf,
                        "its model differs from the recipe's (" + "; ".join(diff) + "): use the checkpoint's "
                        "model.flavor or set model.* to its config.json")]
    return []
