"""A TorchTitan 0.2 TOML job file -> recipe values (torchtitan/config/job_config.py at v0.2.0).

An absent key means TorchTitan's default (warmup 200 steps, linear decay, weight decay 0.1,
bf16 params under FSDP, selective AC of every 2nd block, ...), which the import writes out.
TorchTitan's lr schedule is meshforge's exactly: (s+1)/W warmup, then decay (linear, sqrt,
cosine) over the remaining steps from the first step after warmup, or with `decay_ratio` over
the last round(steps * decay_ratio) of them (warmup-stable-decay).
"""

from __future__ import annotations

import math

from meshforge.core.errors import UsageError
from meshforge.migrate.report import Imported
from meshforge.migrate.source import MISSING, Keys
from meshforge.migrate.torchtitan_float8 import float8
from meshforge.migrate.torchtitan_moe import expert_parallel, moe_details
from meshforge.models import MODELS, ModelSpec
from meshforge.models.common.moe import has_experts
from meshforge.parallelisms.pp import MULTI_STAGE_SCHEDULES, SCHEDULES, V_SCHEDULES

HELD_OUT = "TorchTitan's named datasets (c4_validation): point eval.path or eval.split at your copy"
NOT_MAPPED = {
    "job.description": "a comment",
    "job.print_config": "use `run_recipe --print-config`",
    "job.config_file": "this file",
    "profiling": "TorchTitan's profiler: meshforge logs step time, MFU and memory by category",
    "metrics.disable_color_printing": "the terminal is rich's",
    "metrics.save_tb_folder": "TensorBoard events go to the run folder",
    "metrics.save_for_all_ranks": "rank 0 logs every rank's memory (max/min)",
    "model.hf_assets_path": "the tokenizer: set data.tokenizer to its tokenizer.json",
    "model.tokenizer_path": "the tokenizer: set data.tokenizer to its tokenizer.json",
    "model.print_after_conversion": "a debug print",
    "training.dataset": "TorchTitan's named datasets (c4): point data.source/data.path at your copy",
    "training.dataset_path": "TorchTitan's named datasets (c4): point data.source/data.path at your copy",
    "training.gc_debug": "a debug mode (a full collection every step)",
    "parallelism.enable_async_tensor_parallel": "a compile-time TP overlap: same math",
    "parallelism.enable_compiled_autograd": "a compile option: same math",
    "checkpoint.last_save_model_only": "meshforge's last checkpoint holds model and optimizer",
    "checkpoint.export_dtype": "use `meshforge export`",
    "checkpoint.last_save_in_hf": "use `meshforge export --to hf`",
    "checkpoint.enable_first_step_checkpoint": "use `meshforge init` for a step-0 checkpoint",
    "checkpoint.create_seed_checkpoint": "use `meshforge init`",
    "checkpoint.load_only": "a TorchTitan mode",
    "checkpoint.enable_ft_dataloader_checkpoints": "fault tolerance only",
    "checkpoint.initial_load_model_only": "init_from loads the model only",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": "op-level SAC only",
    "activation_checkpoint.early_stop": "an AC recompute detail: same math",
    "activation_checkpoint.visualize_memory_budget_pareto": "a plot",
    "compile.components": "meshforge compiles each block (the loss stays eager)",
    "quantize": "only used with model.converters",
    "float8": "only used with model.converters",
    "comm": "collective timeouts and traces",
    "memory_estimation": "use `meshforge estimate`",
    "fault_tolerance": "TorchFT settings (fault_tolerance.enable is refused)",
    "validation.dataset": HELD_OUT,
    "validation.dataset_path": HELD_OUT,
}
TORCHTITAN_DEFAULT_MODEL = "llama3"  # TorchTitan's own JobConfig default for model.name
UNSUPPORTED = {"fault_tolerance.enable": "TorchFT", "experimental": "custom TorchTitan extensions"}


def from_torchtitan(data: dict, world: int | None, our_flavors: dict) -> Imported:
    """`our_flavors`: meshforge's flavors (family -> name -> args) of every family TorchTitan's
    models import as (torchtitan_families), to name the closest one."""
    out, k = Imported("TorchTitan 0.2"), Keys(data)
    n_layers, moe = _model(k, out, our_flavors)
    dp, pp_microbatch = _parallelism(k, out, world, n_layers, moe)
    _training(k, out, dp, pp_microbatch)
    moe_details(k, out, moe)
    _validation(k, out, dp)
    _optimizer_and_schedule(k, out)
    _checkpoint(k, out)
    float8(k, out)
    if (v := k.take("compile.enable")) is not MISSING:
        out.set("compile.enabled", bool(v))
    if (v := k.take("compile.backend")) is not MISSING:
        out.set("compile.backend", v)
    _activation_checkpoint(k, out)  # after compile: a memory budget needs it
    for key, field in (
        ("metrics.log_freq", "log_every"),
        ("metrics.enable_tensorboard", "tensorboard"),
        ("metrics.enable_wandb", "wandb"),
    ):
        out.set(
            f"logging.{field}", k.take(key, {"log_every": 10, "tensorboard": False, "wandb": False}[field])
        )
    out.set("output_dir", k.take("job.dump_folder", "./torchtitan/outputs"))
    if (v := k.take("job.custom_config_module", "")) != "":
        out.refuse("job.custom_config_module", v, "a custom TorchTitan config extension")
    if k.take("fault_tolerance.enable", False):
        out.refuse("fault_tolerance.enable", True, "TorchFT fault tolerance")
    for key in ("experimental.custom_import", "experimental.custom_args_module"):
        if (v := k.take(key, "")) != "":
            out.refuse(key, v, "a custom TorchTitan extension")
    k.classify_rest(out, NOT_MAPPED, UNSUPPORTED)
    return out


def torchtitan_families() -> dict[str, ModelSpec]:
    """TorchTitan's model.name -> the registered family whose adapter imports its flavors."""
    return {s.adapter.torchtitan_model: s for s in MODELS.values() if s.adapter.torchtitan_model}


def _model(k: Keys, out: Imported, our_flavors: dict) -> tuple[int, bool | None]:
    """The model's fields; returns its number of blocks (for the pipeline layout) and whether it has
    experts (None: the model is refused)."""
    name, flavor = k.take("model.name", TORCHTITAN_DEFAULT_MODEL), k.take("model.flavor", "debugmodel")
    families = torchtitan_families()
    spec = families.get(name)
    if spec is None or flavor not in spec.adapter.torchtitan_flavors:
        known = ", ".join(f"{n}'s ({', '.join(s.adapter.torchtitan_flavors)})" for n, s in families.items())
        out.refuse("model.flavor", f"{name}/{flavor}", f"meshforge imports these TorchTitan flavors: {known}")
        return 0, None
    want, flavors = spec.adapter.torchtitan_flavors[flavor], our_flavors[spec.name]
    # the flavor of ours that matches in shape, else the smallest, with every difference overridden
    same = [n for n, a in flavors.items() if (a.dim, a.n_layers) == (want["dim"], want["n_layers"])]
    ours = same[0] if same else min(flavors, key=lambda n: flavors[n].dim)
    out.set("model.name", spec.name)
    out.set("model.flavor", ours)
    for field, value in want.items():
        have = getattr(flavors[ours], field)
        if (list(have) if isinstance(have, tuple) else have) != value:
            out.set(f"model.{field}", value)
    out.notes.extend(spec.adapter.torchtitan_notes)
    limit, seq = spec.adapter.torchtitan_rope_until.get(flavor), k.take("training.seq_len", 2048)
    k.put("training.seq_len", seq)  # read again with the other training keys
    if limit is not None and seq > limit:
        out.refuse(
            "training.seq_len",
            seq,
            f"{name}/{flavor}: beyond {limit} tokens TorchTitan trains this flavor with YaRN RoPE and a "
            f"scaled softmax, which the import does not map; import with training.seq_len <= {limit}",
        )
    return want["n_layers"], has_experts(flavors[ours])


def _context_parallel(cp: int, rotate: str, out: Imported) -> int:
    """mesh.cp (cp.method stays allgather: TorchTitan's alltoall passes K/V around a ring, closer to
    all-gathering them than to Ulysses, which would also ask heads divisible by cp)."""
    if rotate not in ("allgather", "alltoall"):
        out.refuse("parallelism.context_parallel_rotate_method", rotate, "allgather or alltoall")
    elif rotate == "alltoall":
        out.notes.append(
            "context_parallel_rotate_method = 'alltoall' -> cp.method = allgather: TorchTitan passes K/V "
            "around a ring, meshforge gathers them: the same attention, other traffic (cp.method=alltoall "
            "is Ulysses, heads exchanged)"
        )
    return cp


def _parallelism(
    k: Keys, out: Imported, world: int | None, n_layers: int, moe: bool | None
) -> tuple[int, int | None]:
    """The mesh (expert parallel: torchtitan_moe.py) and pipeline; returns the data-parallel degree
    and the pipeline's microbatch size."""
    p = lambda key, default: k.take(f"parallelism.{key}", default)  # noqa: E731
    rep, shard = p("data_parallel_replicate_degree", 1), p("data_parallel_shard_degree", -1)
    tp, pp = p("tensor_parallel_degree", 1), p("pipeline_parallel_degree", 1)
    cp = _context_parallel(
        p("context_parallel_degree", 1), p("context_parallel_rotate_method", "allgather"), out
    )
    if shard == -1:
        if world is None:
            raise UsageError(
                "parallelism.data_parallel_shard_degree = -1 needs the world size: pass --world N"
            )
        if world % (rest := rep * cp * tp * pp):
            raise UsageError(f"--world {world} is not a multiple of replicate x cp x tp x pp = {rest}")
        shard = world // rest
    out.set("mesh.dp_replicate", rep)
    out.set("mesh.dp_shard", shard)
    out.set("mesh.cp", cp)
    out.set("mesh.tp", tp)
    out.set("mesh.pp", pp)
    expert_parallel(k, out, moe, shard, cp, tp)
    out.set("tp.loss_parallel", not p("disable_loss_parallel", False))
    reshard = p("fsdp_reshard_after_forward", "default")
    out.set("fsdp.reshard_after_forward", {"always": True, "never": False}.get(reshard, pp == 1))
    schedule = p("pipeline_parallel_schedule", "1F1B")
    if (csv := p("pipeline_parallel_schedule_csv", "")) not in ("", None):
        out.refuse("parallelism.pipeline_parallel_schedule_csv", csv, "a custom schedule from CSV")
    if (fqns := p("module_fqns_per_model_part", None)) is not None:
        out.refuse("parallelism.module_fqns_per_model_part", fqns, "set pp.layers_per_stage")
    first, last = (
        p("pipeline_parallel_first_stage_less_layers", 1),
        p("pipeline_parallel_last_stage_less_layers", 1),
    )
    per_stage = p("pipeline_parallel_layers_per_stage", None)
    mbs = p("pipeline_parallel_microbatch_size", 1)
    if pp > 1:
        if schedule not in SCHEDULES:
            out.refuse(
                "parallelism.pipeline_parallel_schedule",
                schedule,
                f"meshforge's schedules: {', '.join(SCHEDULES)}",
            )
        else:
            out.set("pp.schedule", schedule)
        multi = schedule in MULTI_STAGE_SCHEDULES + V_SCHEDULES
        if per_stage is not None:
            stages = math.ceil((n_layers + first + last) / per_stage)
            out.set("pp.stages_per_rank", max(1, stages // pp) if multi else 1)
        else:
            out.set("pp.stages_per_rank", 2 if multi else 1)
        out.set("pp.embedding_weight", float(first))
        out.set("pp.output_weight", float(last))
        out.notes.append(
            f"pipeline: the first stage holds {first} block(s) fewer for the embedding and the last {last} "
            "fewer for the output (pp.embedding_weight/output_weight; meshforge's split: see "
            "`meshforge pp-schedule`)"
        )
        return shard * rep, mbs
    return shard * rep, None


def _training(k: Keys, out: Imported, dp: int, pp_microbatch: int | None) -> None:
    t = lambda key, default: k.take(f"training.{key}", default)  # noqa: E731
    local, global_ = t("local_batch_size", 8), t("global_batch_size", -1)
    out.set("train.micro_batch_size", local)
    out.set("train.global_batch_size", global_)
    out.set("train.grad_accum_steps", -1 if global_ != -1 else 1)
    if pp_microbatch is not None:
        if local % pp_microbatch:
            raise UsageError(
                f"training.local_batch_size = {local} is not a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size = {pp_microbatch}"
            )
        out.set("pp.microbatches", local // pp_microbatch)
    seq = t("seq_len", 2048)
    out.set("train.seq_len", seq)
    out.set("model.max_seq_len", seq)  # TorchTitan sizes RoPE to the training sequence
    out.set("train.max_norm", float(t("max_norm", 1.0)))
    out.set("train.steps", t("steps", 10000))
    out.set("train.deterministic", t("deterministic", False))
    out.set("train.gc_every", t("gc_freq", 50))
    out.set("fsdp.cpu_offload", t("enable_cpu_offload", False))
    if (seed := t("seed", None)) is not None:
        out.set("seed", seed)
    else:
        out.notes.append(
            "training.seed unset (TorchTitan: unseeded): meshforge seeds the model with seed = 0"
        )
    if (dtype := t("dtype", "float32")) != "float32":
        out.refuse("training.dtype", dtype, "training without fp32 master weights: use mixed_precision_param")
    param, reduce = t("mixed_precision_param", "bfloat16"), t("mixed_precision_reduce", "float32")
    if dp > 1:  # TorchTitan's mixed precision is FSDP's: without data parallelism it trains in fp32
        out.set("fsdp.param_dtype", param)
        out.set("fsdp.reduce_dtype", reduce)
    else:
        out.set("fsdp.param_dtype", "float32")
        out.notes.append(
            f"mixed_precision_param = {param!r} applies only under FSDP in TorchTitan: here fp32"
        )


def _validation(k: Keys, out: Imported, dp: int) -> None:
    """TorchTitan's validation -> meshforge's [eval]: the same held-out loss, every `freq` steps, over
    `steps` batches of validation.local_batch_size per dp rank (meshforge's batches are global ones)."""
    v = lambda key, default: k.take(f"validation.{key}", default)  # noqa: E731
    if not v("enable", False):
        out.set("eval.every", 0)
        for key, value in list(k.data.get("validation", {}).items()):
            out.skip(f"validation.{key}", k.take(f"validation.{key}"), "validation is off (enable = false)")
        return
    freq, steps, local, seq = v("freq", 10), v("steps", -1), v("local_batch_size", 8), v("seq_len", 2048)
    out.set("eval.every", freq)
    if seq != out.values["train.seq_len"]:
        out.refuse("validation.seq_len", seq, "meshforge evaluates at the training sequence length")
    if steps == -1:
        out.refuse(
            "validation.steps", -1, "the whole validation set: meshforge evaluates a fixed number of batches"
        )
        return
    samples, batch = steps * local * dp, out.values["train.global_batch_size"]
    # the eval loop draws whole training global batches: micro x accum x dp when the global is derived
    batch = out.values["train.micro_batch_size"] * dp if batch == -1 else batch
    if samples % batch:
        out.refuse(
            "validation.local_batch_size",
            local,
            f"{steps} steps x {local} x dp {dp} = {samples} samples are not whole global batches of {batch}",
        )
        return
    out.set("eval.batches", samples // batch)
    out.notes.append(
        f"validation: every {freq} steps over {samples} held-out samples (eval.batches = {samples // batch} "
        "global batches); TorchTitan also validates at step 1, meshforge after the last step"
    )


def _optimizer_and_schedule(k: Keys, out: Imported) -> None:
    name = k.take("optimizer.name", "AdamW")
    wd = float(k.take("optimizer.weight_decay", 0.1))
    if name not in ("AdamW", "Adam") or (name == "Adam" and wd > 0):
        out.refuse("optimizer.name", name, "meshforge trains with AdamW (Adam when weight_decay = 0)")
    if k.take("optimizer.early_step_in_backward", False):
        out.refuse(
            "optimizer.early_step_in_backward", True, "steps inside backward cannot clip by the global norm"
        )
    out.set("optimizer.lr", float(k.take("optimizer.lr", 8e-4)))
    out.set("optimizer.eps", float(k.take("optimizer.eps", 1e-8)))
    out.set("optimizer.weight_decay", wd)
    out.set("optimizer.betas", [0.9, 0.95])  # fixed in TorchTitan 0.2
    out.set("optimizer.implementation", k.take("optimizer.implementation", "fused"))
    out.set("lr_scheduler.warmup_steps", int(k.take("lr_scheduler.warmup_steps", 200)))
    decay = k.take("lr_scheduler.decay_type", "linear")
    if decay not in ("linear", "sqrt", "cosine"):
        out.refuse("lr_scheduler.decay_type", decay, "TorchTitan decays by linear, sqrt or cosine")
    out.set("lr_scheduler.decay", decay if decay in ("linear", "sqrt", "cosine") else "linear")
    out.set("lr_scheduler.min_lr_ratio", float(k.take("lr_scheduler.min_lr_factor", 0.0)))
    ratio = k.take("lr_scheduler.decay_ratio", None)  # warmup-stable-decay, TorchTitan's arithmetic
    if ratio is not None:
        out.set("lr_scheduler.decay_ratio", float(ratio))


def _checkpoint(k: Keys, out: Imported) -> None:
    c = lambda key, default: k.take(f"checkpoint.{key}", default)  # noqa: E731
    enabled = c("enable", False)
    out.set("checkpoint.enabled", enabled)
    out.set("checkpoint.folder", c("folder", "checkpoint"))
    out.set("checkpoint.interval", c("interval", 500))
    out.set("checkpoint.keep_latest", c("keep_latest_k", 10))
    out.set("checkpoint.async_save", c("async_mode", "disabled") != "disabled")
    if enabled:
        out.set("checkpoint.load", "auto")  # TorchTitan resumes from its folder when it holds a checkpoint
    path, in_hf = c("initial_load_path", None), c("initial_load_in_hf", False)
    if path is not None:
        if in_hf:
            out.set("checkpoint.init_from_hf", path)
        else:
            out.refuse(
                "checkpoint.initial_load_path",
                path,
                "a TorchTitan DCP folder: `meshforge import --from torchtitan` it first",
            )
    if (step := c("load_step", -1)) != -1:
        out.refuse("checkpoint.load_step", step, "set checkpoint.load to that step's folder")
    if (excl := c("exclude_from_loading", [])) != []:
        out.refuse("checkpoint.exclude_from_loading", excl, "partial loads")
    c("initial_load_in_hf_quantized", False)


def _activation_checkpoint(k: Keys, out: Imported) -> None:
    mode = k.take("activation_checkpoint.mode", "selective")
    option = str(k.take("activation_checkpoint.selective_ac_option", "2"))
    budget = k.take("activation_checkpoint.memory_budget", 0.5)
    if mode in ("none", "full"):
        out.set("activation_checkpoint.mode", mode)
    elif mode == "selective" and option.isdigit():
        out.set("activation_checkpoint.mode", "selective")
        out.set("activation_checkpoint.selective_every", int(option))
    elif mode == "selective" and option == "op" and out.values.get("mesh.ep", 1) > 1:
        out.set("activation_checkpoint.mode", "full")
        out.notes.append(
            "activation_checkpoint selective/op with expert parallel: full AC instead (meshforge refuses "
            "per-op AC with ep on torch 2.13, docs/parallelisms.md; more recompute, same math)"
        )
    elif mode == "selective" and option == "op":
        out.set("activation_checkpoint.mode", "op")
        out.notes.append(
            "activation_checkpoint selective/op: meshforge's per-op AC, TorchTitan's policy (keep the listed "
            "ops' outputs but every second matmul's); its op list is activation_checkpoint.op_save's default"
        )
    elif mode == "memory_budget" and out.values.get("compile.enabled"):
        out.set("activation_checkpoint.mode", "memory_budget")
        out.set("activation_checkpoint.memory_budget", float(budget))
    elif mode == "memory_budget":
        out.refuse(
            "activation_checkpoint.mode", mode, "TorchTitan needs compile.enable for a memory budget too"
        )
    else:
        out.refuse("activation_checkpoint.selective_ac_option", option, "an int (every Nth block) or 'op'")
