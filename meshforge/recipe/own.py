"""The rules a recipe obeys on its own, before any model family or parallelism is asked:
choices, ranges, mesh degrees against the world size, batch arithmetic, data settings, and
(inert.py) settings the recipe's own choices leave unread.

Each Problem names the field, the bad value and a fix (the nearest valid values where there
are some). `resolve` also fills in the -1 ("derive it") fields.
"""

from __future__ import annotations

import math

from meshforge.configs import Recipe
from meshforge.configs.activation_checkpoint import MODES as AC_MODES
from meshforge.core.errors import Problem, nearest
from meshforge.core.topology import MESH_DIMS

from .inert import check_inert
from .optimizer import check_optimizer, check_schedule


def resolve(recipe: Recipe, world_size: int | None) -> list[Problem]:
    """Resolve -1 mesh degrees and batch sizes in place; the problems found doing so."""
    problems = resolve_mesh(recipe, world_size)
    if not problems:
        problems += resolve_batch(recipe)
    return problems


def check(recipe: Recipe) -> list[Problem]:
    """Choices, ranges, data and evaluation settings, settings left unread (after `resolve`)."""
    checks = (
        check_enums,
        check_ranges,
        check_optimizer,
        check_schedule,
        check_data,
        check_eval,
        check_backend,
        check_inert,
    )
    return [p for check_one in checks for p in check_one(recipe)]


def choice_problems(choices: dict[str, tuple[object, tuple]]) -> list[Problem]:
    """A Problem for every field whose value is not among its choices."""
    return [
        Problem(name, value, f"must be one of {', '.join(map(str, valid))}")
        for name, (value, valid) in choices.items()
        if value not in valid
    ]


def check_enums(r: Recipe) -> list[Problem]:
    choices = {
        "train.device": (r.train.device, ("auto", "cpu", "cuda")),
        "lr_scheduler.decay": (r.lr_scheduler.decay, ("cosine", "linear", "sqrt", "constant")),
        "lr_scheduler.warmup_shape": (r.lr_scheduler.warmup_shape, ("linear", "log")),
        "lr_scheduler.convention": (r.lr_scheduler.convention, ("torchtitan", "deepspeed")),
        "activation_checkpoint.mode": (r.activation_checkpoint.mode, AC_MODES),
        "data.source": (r.data.source, ("synthetic", "files", "hf")),
        "data.text_sample_by": (r.data.text_sample_by, ("document", "paragraph", "line")),
        "optimizer.muon.ns_dtype": (r.optimizer.muon.ns_dtype, ("bfloat16", "float32")),
        "optimizer.muon.adjust_lr": (r.optimizer.muon.adjust_lr, ("original", "match_rms_adamw")),
        "optimizer.implementation": (r.optimizer.implementation, ("fused", "foreach", "for-loop")),
        "backend": (r.backend, ("torch", "jax")),
        "sweep.launcher": (r.sweep.launcher, ("auto", "local", "slurm")),
    }
    if r.data.format is not None:
        choices["data.format"] = (r.data.format, ("json", "parquet", "text"))
    if r.logging.wandb_mode is not None:
        choices["logging.wandb_mode"] = (r.logging.wandb_mode, ("online", "offline", "disabled"))
    return choice_problems(choices)


def resolve_mesh(r: Recipe, world_size: int | None) -> list[Problem]:
    m = r.mesh
    degrees = {n: getattr(m, n) for n in MESH_DIMS}
    problems = [
        Problem(f"mesh.{n}", d, "must be a positive degree, or -1 for 'the rest'")
        for n, d in degrees.items()
        if d == 0 or d < -1
    ]
    if m.ep < 1:
        problems.append(
            Problem("mesh.ep", m.ep, "must be a positive degree (it borrows dp_shard x cp's ranks)")
        )
    inferred = [n for n, d in degrees.items() if d == -1]
    if len(inferred) > 1:
        problems.append(Problem("mesh", degrees, f"only one degree may be -1, got {', '.join(inferred)}"))
    if problems:
        return problems
    known = math.prod(d for d in degrees.values() if d != -1)
    spelled = ", ".join(f"{n}={d}" for n, d in degrees.items())
    if world_size is None:
        if inferred:
            return [
                Problem(
                    f"mesh.{inferred[0]}", -1, "needs a world size: run under torchrun, or pass --nproc N"
                )
            ]
        return []
    if inferred:
        if world_size % known:
            return [
                Problem(
                    f"mesh.{inferred[0]}",
                    -1,
                    f"world size {world_size} is not divisible by the other degrees ({spelled}, "
                    f"product {known}); use a world size that is a multiple of {known}",
                )
            ]
        setattr(m, inferred[0], world_size // known)
    elif known != world_size:
        return [
            Problem(
                "mesh",
                spelled,
                f"{'*'.join(MESH_DIMS)} = {known} but the world size is {world_size}; "
                f"set one degree to -1 to take the rest, or run {known} processes",
            )
        ]
    return []


def resolve_batch(r: Recipe) -> list[Problem]:
    t, dp = r.train, r.mesh.dp_replicate * r.mesh.dp_shard
    g, m, a = t.global_batch_size, t.micro_batch_size, t.grad_accum_steps
    named = (("global_batch_size", g), ("micro_batch_size", m), ("grad_accum_steps", a))
    unknown = [n for n, v in named if v == -1]
    bad = [
        Problem(f"train.{n}", v, "must be positive, or -1 to derive it from the other two")
        for n, v in named
        if v == 0 or v < -1
    ]
    if bad:
        return bad
    if len(unknown) > 1:
        return [
            Problem(
                "train", unknown, "set at least two of global_batch_size, micro_batch_size, grad_accum_steps"
            )
        ]
    if g == -1:
        t.global_batch_size = m * a * dp
        return []
    if m == -1 or a == -1:
        known = a if m == -1 else m
        if g % (known * dp):
            name = "micro_batch_size" if m == -1 else "grad_accum_steps"
            valid = [known * dp * k for k in range(1, g // (known * dp) + 2)]
            return [
                Problem(
                    "train.global_batch_size",
                    g,
                    f"must be a multiple of {'grad_accum_steps' if m == -1 else 'micro_batch_size'} x dp "
                    f"= {known * dp} to derive {name}; nearest valid: {nearest(g, valid)}",
                )
            ]
        setattr(t, "micro_batch_size" if m == -1 else "grad_accum_steps", g // (known * dp))
        return []
    if g != m * a * dp:
        return [
            Problem(
                "train.global_batch_size",
                g,
                f"must equal micro_batch_size x grad_accum_steps x dp = {m} x {a} x {dp} = {m * a * dp}; "
                f"set it to {m * a * dp}, or set one of the three to -1 to derive it",
            )
        ]
    return []


def check_backend(r: Recipe) -> list[Problem]:
    """backend=jax trains data- and tensor-parallel fp32/bf16 recipes, with torch's checkpoints."""
    if r.backend != "jax":
        return []
    why = "backend=jax trains data- and tensor-parallel recipes"
    problems = []
    if r.mesh.pp > 1:
        problems.append(
            Problem(
                "mesh.pp",
                r.mesh.pp,
                f"{why}; pipeline parallelism is torch-only: set mesh.pp=1 "
                "(and give its ranks to dp_shard or tp) or backend=torch",
            )
        )
    if r.fsdp.param_dtype == "float16":
        problems.append(
            Problem(
                "fsdp.param_dtype",
                r.fsdp.param_dtype,
                f"{why} in float32 or bfloat16: float16 needs loss scaling, which is torch-only; "
                "set fsdp.param_dtype=bfloat16 or backend=torch",
            )
        )
    if r.fsdp.param_dtype == "bfloat16" and r.mesh.dp_replicate * r.mesh.dp_shard == 1:
        problems.append(
            Problem(
                "fsdp.param_dtype",
                r.fsdp.param_dtype,
                f"{why} in bfloat16 as FSDP's MixedPrecisionPolicy does; without data parallelism the "
                "torch run autocasts instead (norms and embeddings in fp32), which JAX does not mirror: "
                "add a dp_shard or dp_replicate degree, or use float32",
            )
        )
    if r.fsdp.reduce_dtype != "float32":
        problems.append(
            Problem(
                "fsdp.reduce_dtype",
                r.fsdp.reduce_dtype,
                f"{why} with gradients summed as XLA partitions the step (no reduce dtype to set); "
                "set fsdp.reduce_dtype=float32 or backend=torch",
            )
        )
    if r.mesh.cp > 1:
        problems.append(
            Problem(
                "mesh.cp",
                r.mesh.cp,
                f"{why}; context parallelism is torch-only: set mesh.cp=1 (and give its ranks to "
                "dp_shard or tp) or backend=torch",
            )
        )
    c = r.checkpoint
    if c.async_save:
        problems.append(
            Problem(
                "checkpoint.async_save",
                True,
                f"{why} and saves their checkpoints synchronously (one controller process); "
                "set checkpoint.async_save=false",
            )
        )
    if c.init_from_hf:
        problems.append(
            Problem(
                "checkpoint.init_from_hf",
                c.init_from_hf,
                f"{why} from meshforge checkpoints (checkpoint.load or init_from): convert the HF folder "
                "with `meshforge import DIR --from hf RECIPE --out SEED` and set checkpoint.init_from=SEED",
            )
        )
    return problems


def check_ranges(r: Recipe) -> list[Problem]:
    o, t, s, lg, ls = r.optimizer, r.train, r.lr_scheduler, r.logging, r.loss_scale
    sl = r.sweep.slurm
    checks = [
        ("optimizer.lr", o.lr, o.lr > 0, "must be > 0, e.g. 3e-4"),
        ("optimizer.weight_decay", o.weight_decay, o.weight_decay >= 0, "must be >= 0"),
        ("optimizer.eps", o.eps, o.eps > 0, "must be > 0, e.g. 1e-8"),
        (
            "optimizer.betas",
            o.betas,
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            "must be two numbers in [0, 1), e.g. [0.9, 0.95]",
        ),
        ("train.steps", t.steps, t.steps > 0, "must be > 0"),
        ("train.seq_len", t.seq_len, t.seq_len > 0, "must be > 0"),
        ("train.max_norm", t.max_norm, t.max_norm >= 0, "must be >= 0 (0 disables clipping)"),
        ("train.cpu_threads", t.cpu_threads, t.cpu_threads >= 0, "must be >= 0 (0 = automatic)"),
        ("train.max_bad_steps", t.max_bad_steps, t.max_bad_steps >= 0, "must be >= 0"),
        ("train.gc_every", t.gc_every, t.gc_every >= 0, "must be >= 0 (0 = Python's automatic collection)"),
        ("lr_scheduler.warmup_steps", s.warmup_steps, 0 <= s.warmup_steps, "must be >= 0"),
        ("lr_scheduler.min_lr_ratio", s.min_lr_ratio, 0 <= s.min_lr_ratio <= 1, "must be in [0, 1]"),
        ("lr_scheduler.warmup_start", s.warmup_start, 0 <= s.warmup_start <= 1, "must be in [0, 1]"),
        (
            "lr_scheduler.warmup_shape",
            s.warmup_shape,
            s.warmup_shape != "log" or s.convention == "deepspeed",
            "the log warmup is DeepSpeed's formula on DeepSpeed's step count: set "
            "lr_scheduler.convention=deepspeed, or warmup_shape=linear",
        ),
        (
            "lr_scheduler.warmup_steps",
            s.warmup_steps,
            s.convention != "deepspeed" or s.warmup_steps >= 1,
            "DeepSpeed's schedules warm up for at least 1 step (2 in effect): set it >= 1",
        ),
        ("logging.log_every", lg.log_every, lg.log_every > 0, "must be > 0"),
        ("logging.warmup_steps", lg.warmup_steps, lg.warmup_steps >= 0, "must be >= 0"),
        ("logging.flush_every", lg.flush_every, lg.flush_every > 0, "must be > 0"),
        (
            "logging.memory_breakdown_step",
            lg.memory_breakdown_step,
            lg.memory_breakdown_step >= 0,
            "must be >= 0 (0 turns the per-category memory step off)",
        ),
        (
            "activation_checkpoint.selective_every",
            r.activation_checkpoint.selective_every,
            r.activation_checkpoint.selective_every > 0,
            "must be > 0",
        ),
        (
            "activation_checkpoint.memory_budget",
            r.activation_checkpoint.memory_budget,
            0 <= r.activation_checkpoint.memory_budget <= 1,
            "a share of the activations: between 0 (recompute what can be) and 1 (keep all)",
        ),
        ("data.markov_branching", r.data.markov_branching, r.data.markov_branching > 0, "must be > 0"),
        ("checkpoint.interval", r.checkpoint.interval, r.checkpoint.interval > 0, "must be > 0"),
        (
            "checkpoint.keep_latest",
            r.checkpoint.keep_latest,
            r.checkpoint.keep_latest >= 0,
            "must be >= 0 (0 keeps all)",
        ),
        ("pp.stages_per_rank", r.pp.stages_per_rank, r.pp.stages_per_rank >= 1, "must be >= 1"),
        ("loss_scale.initial", ls.initial, ls.initial > 0, "must be > 0, e.g. 65536"),
        ("loss_scale.growth_interval", ls.growth_interval, ls.growth_interval >= 1, "must be >= 1"),
        ("loss_scale.growth_factor", ls.growth_factor, ls.growth_factor >= 1, "must be >= 1, e.g. 2"),
        ("loss_scale.backoff_factor", ls.backoff_factor, 0 < ls.backoff_factor < 1, "must be in (0, 1)"),
        (
            "loss_scale.min_scale",
            ls.min_scale,
            0 < ls.min_scale <= ls.initial,
            f"must be in (0, loss_scale.initial={ls.initial}], e.g. 1",
        ),
        ("eval.every", r.eval.every, r.eval.every >= 0, "must be >= 0 (0 = no evaluation)"),
        ("eval.batches", r.eval.batches, r.eval.batches >= 1, "must be >= 1"),
        ("sweep.steps", r.sweep.steps, r.sweep.steps > 0, "must be > 0"),
        ("sweep.timeout_s", r.sweep.timeout_s, r.sweep.timeout_s > 0, "must be > 0"),
        ("sweep.slurm.gpus_per_node", sl.gpus_per_node, sl.gpus_per_node >= 1, "must be >= 1, e.g. 8"),
        ("sweep.slurm.max_concurrent", sl.max_concurrent, sl.max_concurrent >= 1, "must be >= 1"),
        ("sweep.slurm.poll_s", sl.poll_s, sl.poll_s > 0, "must be > 0, e.g. 30"),
    ]
    return [Problem(name, value, fix) for name, value, ok, fix in checks if not ok]


def check_eval(r: Recipe) -> list[Problem]:
    """A held-out set that is really held out, where evaluation is implemented."""
    e, d = r.eval, r.data
    if e.every <= 0:  # off (a negative value is check_ranges')
        return []
    held_out = {
        "files": ("eval.path", e.path, "a glob of held-out files"),
        "hf": ("eval.split", e.split, "a split"),
    }
    problems = []
    if d.source in held_out and not held_out[d.source][1]:
        name, value, what = held_out[d.source]
        problems.append(
            Problem(name, value, f"data.source={d.source!r} evaluates on {what}, never on training data")
        )
    unread = {
        "eval.path": e.path if d.source != "files" else None,
        "eval.split": e.split if d.source != "hf" else None,
    }
    problems += [
        Problem(k, v, f"is not read with data.source = {d.source!r}") for k, v in unread.items() if v
    ]
    return problems


def check_data(r: Recipe) -> list[Problem]:
    d, c = r.data, r.checkpoint
    problems = []
    if d.source == "files" and not d.path:
        problems.append(
            Problem(
                "data.path", d.path, "data.source='files' needs a glob of local files, e.g. 'corpus/*.jsonl'"
            )
        )
    if d.source == "hf" and not d.hf_dataset:
        problems.append(Problem("data.hf_dataset", d.hf_dataset, "data.source='hf' needs a dataset name"))
    if d.shuffle_windows < 0:
        problems.append(Problem("data.shuffle_windows", d.shuffle_windows, "must be >= 0 (0 = stream order)"))
    if c.init_from_hf and c.init_from:
        problems.append(
            Problem(
                "checkpoint.init_from_hf",
                c.init_from_hf,
                "set either checkpoint.init_from or checkpoint.init_from_hf, not both",
            )
        )
    return problems
