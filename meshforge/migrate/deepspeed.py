"""A DeepSpeed JSON config -> recipe values (DeepSpeed 0.19's keys and defaults).

An absent key means DeepSpeed's default, which is often not ours (no lr schedule, no
clipping, Adam's betas (0.9, 0.999), weight decay 0): the import writes those explicitly.
"""

from __future__ import annotations

from meshforge.core.errors import UsageError
from meshforge.migrate.deepspeed_lr import scheduler
from meshforge.migrate.deepspeed_moe import auto_ep
from meshforge.migrate.report import Imported
from meshforge.migrate.source import MISSING, Keys

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "float32": "float32"}

DIVIDE = "when DeepSpeed divides by dp: meshforge divides the loss by the global token count"
NOT_MAPPED = {
    "zero_optimization": "a ZeRO tuning knob (buckets, prefetch, persistence, saving): FSDP2 has its own",
    "pipeline.stage_id": "this process's stage: meshforge derives each rank's stage from its mesh coordinate",
    "pipeline.seed_layers": "layer seeding: meshforge draws every weight from (seed, name) on any layout",
    "pipeline.pipe_partitioned": "DeepSpeed's activation-transfer optimization",
    "pipeline.grad_partitioned": "DeepSpeed's activation-transfer optimization",
    "pipeline.use_reentrant": "how DeepSpeed's checkpointing runs backward",
    "activation_checkpointing": "a Megatron checkpointing option: meshforge checkpoints whole blocks",
    "fp16.consecutive_hysteresis": "meshforge backs off at every overflow",
    "fp16.auto_cast": "meshforge casts through FSDP2's policy or autocast",
    "fp16.fp16_master_weights_and_grads": "meshforge keeps fp32 master weights",
    "bf16": "a DeepSpeed bf16 optimizer option: meshforge keeps fp32 master weights",
    "optimizer.params.torch_adam": "which kernel: see optimizer.implementation",
    "tensorboard.output_path": "TensorBoard events go to the run folder",
    "tensorboard.job_name": "the run name is the recipe's run_name",
    "wall_clock_breakdown": "a DeepSpeed profiler: meshforge logs step time and throughput",
    "flops_profiler": "a DeepSpeed profiler: meshforge logs MFU",
    "comms_logger": "a DeepSpeed profiler",
    "memory_breakdown": "meshforge logs memory per rank and by category",
    "dump_state": "a DeepSpeed debug print",
    "csv_monitor": "meshforge writes metrics.jsonl",
    "comet": "meshforge logs to W&B, TensorBoard and metrics.jsonl",
    "prescale_gradients": DIVIDE,
    "gradient_predivide_factor": DIVIDE,
    "zero_allow_untested_optimizer": "a DeepSpeed guard",
    "zero_force_ds_cpu_optimizer": "a DeepSpeed guard",
    "checkpoint": "DeepSpeed's checkpoint format options: meshforge writes DCP, loadable on any mesh",
    "autotuning": "DeepSpeed's tuner: use `meshforge sweep`",
    "aio": "NVMe I/O settings",
    "nebula": "DeepSpeed's checkpoint service",
}
UNSUPPORTED = {
    "amp": "NVIDIA apex AMP: use fp16 or bf16",
    "zero_optimization.zero_quantized_weights": "ZeRO++ quantized weights",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ quantized gradients",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hierarchical partitions: use HSDP",
    "zero_optimization.mics_shard_size": "MiCS sharding: use mesh.dp_replicate x mesh.dp_shard (HSDP)",
    "moe": "not a DeepSpeed key: its MoE layers are model code (deepspeed.moe); AutoEP's is expert_parallel",
    "elasticity": "elastic batch sizes",
    "compression_training": "compression",
    "sparse_attention": "sparse attention changes the model",
    "data_efficiency": "curriculum data sampling",
    "curriculum_learning": "curriculum data sampling",
    "progressive_layer_drop": "layer drop changes the model",
    "quantize_training": "quantized training",
    "weight_quantization": "quantized weights",
    "hybrid_engine": "RLHF inference engine",
    "torch_autocast": "DeepSpeed's autocast mode: use fp16 or bf16",
    "eigenvalue": "eigenvalue-based layer scaling",
    "sparse_gradients": "sparse embedding gradients",
    "data_types": "gradient accumulation in a reduced dtype: meshforge accumulates in fp32",
    "compile.deepcompile": "DeepSpeed's compiler passes",
    "compile.offload_activation": "DeepSpeed's compiler passes",
}


def _batch(tb, mb, ga, dp: int) -> tuple[int, int, int]:
    """DeepSpeed's rule (runtime/config.py): any two of the three give the third; all three must agree."""
    for name, v in (
        ("train_batch_size", tb),
        ("train_micro_batch_size_per_gpu", mb),
        ("gradient_accumulation_steps", ga),
    ):
        if v == "auto":
            raise UsageError(
                f"{name} = 'auto' is filled in by the HF Trainer from its arguments: write the number"
            )
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga = tb // mb // dp
    elif tb is not None and ga is not None:
        mb = tb // dp // ga
    elif mb is not None and ga is not None:
        tb = mb * ga * dp
    elif tb is not None:
        ga, mb = 1, tb // dp
    elif mb is not None:
        tb, ga = mb * dp, 1
    else:
        raise UsageError(
            "DeepSpeed: Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
        )
    for what, v in (
        ("Train batch size", tb),
        ("Micro batch size per gpu", mb),
        ("Gradient accumulation steps", ga),
    ):
        if v <= 0:
            raise UsageError(
                f"DeepSpeed: {what}: {v} has to be greater than 0 (data-parallel world size {dp})"
            )
    if tb != mb * ga * dp:
        raise UsageError(
            "DeepSpeed: Check batch related parameters. train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size {tb} != {mb} * {ga} * {dp}"
        )
    return tb, mb, ga


def from_deepspeed(
    data: dict, world: int, block_weights: tuple[float, float], experts: int | None = None
) -> Imported:
    """`block_weights`: the model's embedding and output parameters in units of one block's,
    for DeepSpeed's partition by parameters; `experts`: its experts per MoE layer (None: dense)."""
    out, k = Imported("DeepSpeed"), Keys(data)
    pp = _pipeline(k, out, world, block_weights)
    sp = _ulysses(k, out, world // pp)
    dp = world // (pp * sp)
    get = lambda key: None if (v := k.take(key)) is MISSING else v  # noqa: E731
    tb, mb, ga = _batch(
        get("train_batch_size"), get("train_micro_batch_size_per_gpu"), get("gradient_accumulation_steps"), dp
    )
    out.set("train.global_batch_size", tb)
    if pp > 1:  # DeepSpeed's pipeline runs gradient_accumulation_steps microbatches of micro size per step
        out.set("train.micro_batch_size", mb * ga)
        out.set("train.grad_accum_steps", 1)
        out.set("pp.microbatches", ga)
        out.notes.append(
            f"pipeline: DeepSpeed's {ga} accumulation steps of {mb} samples are the pipeline's microbatches: "
            f"micro_batch_size = {mb * ga} split into pp.microbatches = {ga}"
        )
    else:
        out.set("train.micro_batch_size", mb)
        out.set("train.grad_accum_steps", ga)
    out.set("mesh.tp", 1)  # DeepSpeed tensor parallelism comes from Megatron code, not the JSON
    _zero(k, out, dp)
    auto_ep(k, out, experts, world, pp, sp)
    _precision(k, out)
    _optimizer(k, out)
    scheduler(k, out)
    out.set("train.max_norm", float(k.take("gradient_clipping", 0.0)))  # DeepSpeed's default: no clipping
    if k.has("activation_checkpointing"):
        out.set("activation_checkpoint.mode", "full")
        out.notes.append(
            "activation_checkpointing: DeepSpeed checkpoints what the model code wraps; meshforge every block"
        )
    if (v := k.take("steps_per_print")) is not MISSING:
        out.set("logging.log_every", int(v))
    _monitors(k, out)
    if (v := k.take("compile.enabled")) is not MISSING:
        out.set("compile.enabled", bool(v))
    k.classify_rest(out, NOT_MAPPED, UNSUPPORTED)
    return out


def _ulysses(k: Keys, out: Imported, ranks: int) -> int:
    """DeepSpeed-Ulysses' sequence_parallel_size is mesh.cp with cp.method = alltoall (heads
    exchanged); ZeRO partitions over its dp x sp ranks as FSDP does over dp_shard x cp, and the
    data-parallel degree the batch divides by leaves sp out, as DeepSpeed's does."""
    sp = k.take("sequence_parallel_size", 1)
    if not isinstance(sp, int) or sp < 1 or ranks % sp:
        raise UsageError(f"sequence_parallel_size = {sp!r} must be a positive divisor of {ranks} ranks")
    out.set("mesh.cp", sp)
    if sp > 1:
        out.set("cp.method", "alltoall")
        out.notes.append(
            f"sequence_parallel_size = {sp} -> mesh.cp = {sp}, cp.method = alltoall (Ulysses); FSDP shards "
            "over dp_shard x cp as ZeRO partitions over dp x sp"
        )
    return sp


def _pipeline(k: Keys, out: Imported, world: int, block_weights: tuple[float, float]) -> int:
    stages = k.take("pipeline.stages", "auto")
    if stages == "auto":  # no stages in the file: DeepSpeed takes them from PipelineModule in code
        out.set("mesh.pp", 1)
        out.notes.append(
            "no pipeline.stages in the file: mesh.pp = 1 (DeepSpeed reads them from PipelineModule)"
        )
        return 1
    if not isinstance(stages, int) or stages < 1 or world % stages:
        raise UsageError(f"pipeline.stages = {stages!r} must be a positive divisor of --world {world}")
    out.set("mesh.pp", stages)
    out.set("pp.schedule", "1F1B")  # DeepSpeed's TrainSchedule is 1F1B
    method = str(k.take("pipeline.partition", "parameters")).lower()
    if method in ("parameters", "best"):
        emb, head = block_weights
        out.set("pp.embedding_weight", round(emb, 3))
        out.set("pp.output_weight", round(head, 3))
        out.notes.append(
            f"pipeline.partition = {method!r}: balanced by parameters, the embedding counted as {emb:.2f} "
            f"blocks and norm + output as {head:.2f} (meshforge's greedy split, not DeepSpeed's)"
        )
    elif method == "uniform" or method.startswith("type:"):
        out.notes.append(f"pipeline.partition = {method!r}: transformer blocks split evenly over the stages")
    else:
        out.refuse(
            "pipeline.partition", method, "a partition meshforge cannot reproduce; set pp.layers_per_stage"
        )
    if (every := k.take("pipeline.activation_checkpoint_interval", 0)) not in (0, MISSING):
        out.set("activation_checkpoint.mode", "full" if every == 1 else "selective")
        if every > 1:
            out.set("activation_checkpoint.selective_every", int(every))
    return stages


def _zero(k: Keys, out: Imported, dp: int) -> None:
    stage = int(k.take("zero_optimization.stage", 0))
    if stage not in (0, 1, 2, 3):
        raise UsageError(f"zero_optimization.stage = {stage} must be 0, 1, 2 or 3")
    if stage == 0:
        out.set("mesh.dp_replicate", dp)
        out.set("mesh.dp_shard", 1)
        out.notes.append(
            "ZeRO 0 -> plain data parallel: mesh.dp_replicate = dp (every rank holds everything)"
        )
    else:
        out.set("mesh.dp_replicate", 1)
        out.set("mesh.dp_shard", dp)
        out.set("fsdp.reshard_after_forward", stage == 3)
        out.notes.append(
            {
                1: "ZeRO 1 -> FSDP2 without resharding after forward: optimizer state AND gradients sharded "
                "(ZeRO 1 shards only the optimizer state: this uses less memory, the same math)",
                2: "ZeRO 2 -> FSDP2 without resharding after forward: gradients and optimizer state sharded, "
                "parameters gathered once per step (FSDP2 also keeps them sharded between steps)",
                3: "ZeRO 3 -> FSDP2 fully sharded, parameters resharded after forward",
            }[stage]
        )
    for part in ("offload_optimizer", "offload_param"):
        device = k.take(f"zero_optimization.{part}.device", "none")
        for extra in (
            "pin_memory",
            "buffer_count",
            "fast_init",
            "ratio",
            "nvme_path",
            "buffer_size",
            "max_in_cpu",
        ):
            k.take(f"zero_optimization.{part}.{extra}")
        if device == "cpu":
            out.set("fsdp.cpu_offload", True)
            out.notes.append(
                f"zero_optimization.{part} -> fsdp.cpu_offload: FSDP2 offloads parameters, gradients "
                "and optimizer state together"
            )
        elif device == "nvme":
            out.refuse(f"zero_optimization.{part}.device", device, "NVMe offload (ZeRO-Infinity): use cpu")


def _precision(k: Keys, out: Imported) -> None:
    fp16, bf16 = k.take("fp16.enabled", False), k.take("bf16.enabled", False)
    if "auto" in (fp16, bf16):
        raise UsageError("fp16/bf16 enabled = 'auto' is filled in by the HF Trainer: write true or false")
    if fp16 and bf16:
        raise UsageError("fp16.enabled and bf16.enabled are both true: DeepSpeed refuses this too; pick one")
    comm = k.take("communication_data_type")
    if comm is not MISSING:
        if comm not in DTYPE_NAMES:
            out.refuse("communication_data_type", comm, "must be fp32, fp16 or bf16")
        else:
            out.set("fsdp.reduce_dtype", DTYPE_NAMES[comm])
    if bf16:
        out.set("fsdp.param_dtype", "bfloat16")
    if not fp16:
        for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            k.take(f"fp16.{key}")  # DeepSpeed ignores them when fp16 is off
        return
    out.set("fsdp.param_dtype", "float16")
    if comm is MISSING:
        out.notes.append(
            "fp16: DeepSpeed reduces gradients in fp16 by default; meshforge in fp32 (fsdp.reduce_dtype)"
        )
    static = float(k.take("fp16.loss_scale", 0))
    out.set("loss_scale.dynamic", static == 0)
    out.set("loss_scale.initial", static or float(2 ** int(k.take("fp16.initial_scale_power", 16))))
    out.set("loss_scale.growth_interval", int(k.take("fp16.loss_scale_window", 1000)))
    out.set("loss_scale.min_scale", float(k.take("fp16.min_loss_scale", 1)))
    hysteresis = k.take("fp16.hysteresis", 2)
    if static == 0 and hysteresis != 1:
        out.notes.append(
            f"fp16.hysteresis = {hysteresis}: DeepSpeed backs the scale off after {hysteresis} overflows "
            "in a row, meshforge after each (torch's GradScaler rule); the applied updates are the same"
        )


def _optimizer(k: Keys, out: Imported) -> None:
    kind = k.take("optimizer.type")
    if kind is MISSING:
        out.notes.append(
            "no optimizer in the file (DeepSpeed then uses the script's): meshforge's AdamW defaults"
        )
        return
    params = k.data.get("optimizer", {}).get("params", {})
    wd = float(params.get("weight_decay", 0.0))
    adam_w = params.get("adam_w_mode", True)
    if str(kind).lower() not in ("adam", "adamw", "fusedadam"):
        out.refuse("optimizer.type", kind, "meshforge trains with AdamW (Adam when weight_decay = 0)")
        k.take("optimizer")  # its params belong to the refused optimizer
        return
    if str(kind).lower() == "adam" and not adam_w and wd > 0:
        out.refuse(
            "optimizer.params.adam_w_mode",
            False,
            "Adam with L2 weight decay: meshforge's decay is decoupled (AdamW)",
        )
    k.take("optimizer.params.adam_w_mode")
    if k.take("optimizer.params.amsgrad", False):
        out.refuse("optimizer.params.amsgrad", True, "AMSGrad")
    if not k.take("optimizer.params.bias_correction", True):
        out.refuse("optimizer.params.bias_correction", False, "Adam without bias correction")
    out.set("optimizer.name", "adamw")
    out.set("optimizer.lr", float(k.take("optimizer.params.lr", 1e-3)))
    out.set("optimizer.betas", [float(b) for b in k.take("optimizer.params.betas", [0.9, 0.999])])
    out.set("optimizer.eps", float(k.take("optimizer.params.eps", 1e-8)))
    out.set("optimizer.weight_decay", float(k.take("optimizer.params.weight_decay", 0.0)))


def _monitors(k: Keys, out: Imported) -> None:
    if (v := k.take("tensorboard.enabled")) is not MISSING:
        out.set("logging.tensorboard", bool(v))
    if (v := k.take("wandb.enabled")) is not MISSING:
        out.set("logging.wandb", bool(v))
    for key, field in (("project", "wandb_project"), ("team", "wandb_entity"), ("group", "wandb_group")):
        if (v := k.take(f"wandb.{key}")) is not MISSING:
            out.set(f"logging.{field}", v)
