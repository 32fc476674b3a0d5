"""The recipe schema: one dataclass per section, each field with a one-line doc.

TOML recipes are only data; this file is the single source of truth for what a recipe
may say, its defaults, and (through `field_doc`) the help that `meshforge explain` shows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional

from .activation_checkpoint import ActivationCheckpointConfig
from .fields import NO_EVAL, NO_FSDP, NO_PP, NO_SAVE, NO_WANDB, F, unread_with
from .float8 import Float8Config
from .model_mesh import MeshConfig, ModelConfig

__all__ = ["ActivationCheckpointConfig", "Float8Config", "MeshConfig", "ModelConfig"]  # sections kept apart


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = F(
        True,
        "free gathered params after forward (saves memory, costs a 2nd all-gather)" + NO_FSDP,
    )
    param_dtype: str = F(
        "float32",
        "dtype of compute params: float32 | bfloat16 | float16 (with a loss scale, [loss_scale]); "
        "autocast when FSDP is off; float32 stays true fp32 (TF32 off), its MFU is against the fp32 peak",
    )
    reduce_dtype: str = F("float32", "dtype of gradient reductions: float32 | bfloat16 | float16" + NO_FSDP)
    cpu_offload: bool = F(False, "keep sharded params, grads and optimizer state on the CPU")


@dataclass
class LossScaleConfig:
    dynamic: bool = F(
        True, "fp16: halve the scale on overflow, grow it after a clean stretch; false = fixed at initial"
    )
    initial: float = F(65536.0, "fp16: the loss scale to start from (2**16, as torch's GradScaler)")
    growth_interval: int = F(2000, "fp16: multiply the scale by growth_factor after this many clean steps")
    growth_factor: float = F(2.0, "fp16: scale growth after growth_interval clean steps")
    backoff_factor: float = F(0.5, "fp16: scale multiplier on an overflow (the step is skipped)")
    min_scale: float = F(
        1.0, "fp16: an overflow at this scale spends train.max_bad_steps (DeepSpeed's min_loss_scale)"
    )


@dataclass
class TPConfig:
    sequence_parallel: bool = F(
        True, "shard norms and residuals along the sequence between TP regions" + unread_with("mesh.tp = 1")
    )
    loss_parallel: bool = F(
        True, "keep logits vocab-sharded and compute cross-entropy in parallel" + unread_with("mesh.tp = 1")
    )


@dataclass
class CPConfig:
    method: str = F(
        "allgather",
        "allgather (K and V gathered over cp, TorchTitan's) | alltoall (Ulysses: heads exchanged, "
        "needs n_heads and kv_heads / tp divisible by cp)" + unread_with("mesh.cp = 1"),
    )


@dataclass
class PPConfig:
    schedule: str = F(
        "1F1B",
        "GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV"
        + NO_PP,
    )
    microbatches: int = F(-1, "microbatches per step per pipeline; -1 = number of stages" + NO_PP)
    stages_per_rank: int = F(1, "virtual stages per rank (2+ for interleaved/looped/V schedules)" + NO_PP)
    layers_per_stage: Optional[List[int]] = F(
        None, "explicit layer count per stage, e.g. [3, 5]; None = balanced" + NO_PP
    )
    embedding_weight: float = F(
        0.0, "tok_embeddings counted as this many layers when balancing stages" + NO_PP
    )
    output_weight: float = F(0.0, "norm + output counted as this many layers when balancing stages" + NO_PP)


@dataclass
class ProfileConfig:
    start_step: int = F(
        0,
        "first step run under torch.profiler (0: none): a trace per rank in <run>/profile (TensorBoard's "
        "profiler plugin, Perfetto) and the steps' time by part in the summary",
    )
    steps: int = F(2, "how many steps are profiled" + unread_with("profile.start_step = 0", "a switch"))
    record_shapes: bool = F(
        False, "record ops' input shapes (bigger traces)" + unread_with("start_step = 0", "a switch")
    )
    with_stack: bool = F(
        False, "record Python stacks (bigger, slower traces)" + unread_with("start_step = 0", "a switch")
    )
    memory_snapshot: bool = F(
        False,
        "CUDA: the allocator's history over the profiled steps, profile/memory-rank<r>.pickle for "
        "pytorch.org/memory_viz" + unread_with("start_step = 0", "a switch"),
    )


@dataclass
class CompileConfig:
    enabled: bool = F(False, "torch.compile each transformer block")
    backend: str = F("inductor", "torch.compile backend" + unread_with("compile.enabled = false", "a switch"))


@dataclass
class OptimizerConfig:
    name: str = F("adamw", "optimizer: adamw")
    lr: float = F(3e-4, "peak learning rate")
    betas: List[float] = F([0.9, 0.95], "AdamW betas")
    eps: float = F(1e-8, "AdamW epsilon")
    weight_decay: float = F(0.1, "decoupled weight decay")
    implementation: str = F(
        "fused", "fused (one kernel per step; foreach where a parameter cannot) | foreach | for-loop"
    )


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = F(0, "warmup steps from warmup_start to lr")
    warmup_shape: str = F(
        "linear", "how the lr rises in warmup: linear | log (DeepSpeed's default; needs convention=deepspeed)"
    )
    warmup_start: float = F(0.0, "the lr warmup starts from, as a fraction of the peak lr")
    decay: str = F("cosine", "decay after warmup: cosine | linear | constant")
    min_lr_ratio: float = F(
        0.1, "final lr as a fraction of the peak lr; unread with decay = constant (the lr stays at its peak)"
    )
    convention: str = F(
        "torchtitan",
        "step arithmetic: torchtitan (step s from 0 warms up to (s+1)/W, decays from step W) | deepspeed "
        "(WarmupLR, WarmupDecayLR, WarmupCosineLR exactly: step s at DeepSpeed's iteration s-1)",
    )


@dataclass
class TrainConfig:
    steps: int = F(100, "optimizer steps to train")
    seq_len: int = F(128, "tokens per sample")
    global_batch_size: int = F(
        -1, "samples per optimizer step = micro_batch_size * grad_accum_steps * dp; -1 = derive"
    )
    micro_batch_size: int = F(8, "samples per forward/backward on one data-parallel rank; -1 = derive")
    grad_accum_steps: int = F(1, "micro-batches accumulated per step; -1 = derive")
    max_norm: float = F(1.0, "gradient clipping max norm; 0 disables clipping")
    device: str = F("auto", "auto (cuda if available) | cpu | cuda")
    cpu_threads: int = F(0, "torch threads per process on CPU (unread on CUDA); 0 = cores / local processes")
    deterministic: bool = F(False, "use deterministic algorithms (slower on CUDA)")
    max_bad_steps: int = F(0, "skip up to K steps with a non-finite loss or grad norm before stopping")
    gc_every: int = F(
        50,
        "Python's cyclic garbage collector is off while the steps run and every rank collects its young "
        "objects at the end of every Nth step (TorchTitan's gc_freq), so no rank stalls its peers with a "
        "collection of its own; 0 = Python's automatic collection",
    )


@dataclass
class DataConfig:
    source: str = F(
        "synthetic",
        "synthetic (seeded Markov source) | files (local jsonl/parquet/text by glob) | "
        "hf (an HF dataset, streamed)",
    )
    path: Optional[str] = F(
        None, "files: glob of local files, e.g. 'corpus/*.jsonl' (in a recipe file: relative to that file)"
    )
    format: Optional[str] = F(None, "files: json | parquet | text; None = from the files' extension")
    text_sample_by: str = F(
        "document", "files of plain text: a record is a document (file) | paragraph | line"
    )
    hf_dataset: Optional[str] = F(None, "hf: dataset name on the hub (or a local dataset folder), streamed")
    hf_config: Optional[str] = F(None, "hf: the dataset's config (subset) name, e.g. sample-10BT")
    split: str = F("train", "hf: the split to train on")
    text_column: str = F("text", "files/hf: the records' field holding the document's text")
    tokenizer: str = F(
        "byte", "byte (UTF-8 + BOS/EOS, 258 tokens) | an HF tokenizer folder or tokenizer.json | a hub id"
    )
    shuffle_windows: int = F(
        0, "files/hf: shuffle windows within blocks of this many (seeded by data.seed); 0 = off"
    )
    markov_branching: int = F(4, "synthetic: successors per token (lower = easier, lower floor)")
    seed: int = F(
        1234,
        "seed of the data stream (independent of the model seed): the synthetic source, or the "
        "files/hf window shuffle (unread with shuffle_windows = 0: the stream's own order)",
    )


@dataclass
class EvalConfig:
    every: int = F(0, "evaluate every N steps and after the last one; 0 = no evaluation")
    batches: int = F(4, "global batches per evaluation (the same held-out ones every time)" + NO_EVAL)
    path: Optional[str] = F(
        None, "data.source=files: held-out files (a glob), never the training files" + NO_EVAL
    )
    split: Optional[str] = F(None, "data.source=hf: the held-out split, e.g. 'validation'" + NO_EVAL)


@dataclass
class LoggingConfig:
    log_every: int = F(1, "log metrics every N steps")
    tensorboard: bool = F(True, "write TensorBoard events next to metrics.jsonl")
    wandb: bool = F(True, "mirror metrics to Weights & Biases")
    wandb_project: Optional[str] = F(None, "W&B project; None = WANDB_PROJECT, else 'meshforge'" + NO_WANDB)
    wandb_entity: Optional[str] = F(None, "W&B entity (team or user); None = WANDB_ENTITY" + NO_WANDB)
    wandb_group: Optional[str] = F(None, "W&B group (sweeps set it); None = WANDB_RUN_GROUP" + NO_WANDB)
    wandb_tags: Optional[List[str]] = F(None, "W&B tags; None = WANDB_TAGS (comma-separated)" + NO_WANDB)
    wandb_job_type: Optional[str] = F(
        None, "W&B job_type; None = WANDB_JOB_TYPE, else 'train' (sweeps: sweep-point)" + NO_WANDB
    )
    wandb_mode: Optional[str] = F(
        None,
        "online | offline | disabled; None = WANDB_MODE (dryrun = offline), else online with a key, "
        "offline without" + NO_WANDB,
    )
    wandb_log_checkpoint: bool = F(
        False, "log the final checkpoint's location as a W&B artifact (a reference)" + NO_WANDB
    )
    progress: bool = F(True, "show a rich progress bar and summary in the terminal")
    memory_history: bool = F(
        True, "CUDA: record allocator history, dumped as a snapshot if a rank runs out of memory"
    )
    memory_breakdown_step: int = F(
        2, "track memory by category (torch MemTracker) on this step, per rank; 0 = off"
    )
    warmup_steps: int = F(
        2, "steps left out of the throughput summary at the start of a process (compile, allocator)"
    )
    flush_every: int = F(
        10,
        "flush TensorBoard events every N logged steps (and at the end)"
        + unread_with("logging.tensorboard = false", "a switch"),
    )


@dataclass
class CheckpointConfig:
    enabled: bool = F(False, "save distributed checkpoints (DCP) during training")
    folder: str = F("checkpoints", "checkpoint folder, relative to the run folder (or absolute)")
    interval: int = F(500, "save every N steps" + NO_SAVE)
    keep_latest: int = F(2, "keep only the newest K checkpoints; 0 keeps all" + NO_SAVE)
    async_save: bool = F(False, "write checkpoints in the background (dcp.async_save)" + NO_SAVE)
    save_at_end: bool = F(True, "save after the last step" + NO_SAVE)
    load: Optional[str] = F(
        None,
        "resume from 'auto' (this run's newest checkpoint if any, else a fresh start: for requeued jobs), "
        "'latest' (its newest, which must exist) or a checkpoint path",
    )
    init_from: Optional[str] = F(None, "initial weights from a seed checkpoint (`meshforge init`), any mesh")
    init_from_hf: Optional[str] = F(
        None,
        "initial weights from an HF Llama folder (config.json + safetensors); "
        "each rank reads only its shards",
    )


@dataclass
class SlurmConfig:
    partition: Optional[str] = F(None, "sbatch --partition; None = the cluster's default")
    account: Optional[str] = F(None, "sbatch --account; None = your default account")
    time: Optional[str] = F(None, 'sbatch --time, Slurm syntax ("00:30:00"); None = sweep.timeout_s')
    gpus_per_node: int = F(
        8, "ranks per node (torchrun --nproc_per_node); on GPUs also sbatch --gpus-per-node"
    )
    max_concurrent: int = F(4, "points queued or running at once")
    poll_s: float = F(30.0, "seconds between squeue/sacct queries")
    sbatch_args: List[str] = F([], 'more sbatch options, one per entry, e.g. ["--qos=high", "--exclusive"]')
    setup: List[str] = F(
        [], 'shell lines run before srun, e.g. ["module load cuda", "source .venv/bin/activate"]'
    )


@dataclass
class SweepConfig:
    axes: Dict[str, List[str]] = F(
        {}, 'policy axes crossed with every mesh, e.g. "pp.schedule" = ["1F1B", "GPipe"]'
    )
    only: List[str] = F([], 'run only these layouts (labels as printed: "dp8-tp2"); [] = every mesh')
    steps: int = F(10, "steps per sweep point (a short budget: enough to time a layout)")
    timeout_s: int = F(600, "a point still running after this many seconds is stopped and recorded as hung")
    device_memory_gib: Optional[float] = F(None, "skip points whose estimated per-rank memory exceeds this")
    launcher: str = F(
        "auto",
        "local | slurm | auto: each point a local run_recipe, or a Slurm job (sbatch + srun torchrun); "
        "auto = slurm when the world needs more GPUs than this machine has",
    )
    slurm: SlurmConfig = F(SlurmConfig(), "Slurm jobs of a sweep (sweep.launcher = slurm)")


@dataclass
class Recipe:
    model: ModelConfig = F(ModelConfig(), "the transformer")
    mesh: MeshConfig = F(MeshConfig(), "the device mesh")
    fsdp: FSDPConfig = F(FSDPConfig(), "FSDP2 policy")
    loss_scale: LossScaleConfig = F(LossScaleConfig(), "dynamic loss scaling (fsdp.param_dtype=float16)")
    tp: TPConfig = F(TPConfig(), "tensor-parallel policy")
    cp: CPConfig = F(CPConfig(), "context-parallel policy")
    pp: PPConfig = F(PPConfig(), "pipeline-parallel policy")
    activation_checkpoint: ActivationCheckpointConfig = F(
        ActivationCheckpointConfig(), "activation checkpointing"
    )
    compile: CompileConfig = F(CompileConfig(), "torch.compile")
    float8: Float8Config = F(Float8Config(), "float8 training of the linear layers (torchao)")
    profile: ProfileConfig = F(ProfileConfig(), "torch.profiler over chosen steps")
    optimizer: OptimizerConfig = F(OptimizerConfig(), "optimizer")
    lr_scheduler: LRSchedulerConfig = F(LRSchedulerConfig(), "learning-rate schedule")
    train: TrainConfig = F(TrainConfig(), "the training loop")
    data: DataConfig = F(DataConfig(), "the data stream")
    eval: EvalConfig = F(EvalConfig(), "held-out evaluation: eval/loss and eval/perplexity")
    logging: LoggingConfig = F(LoggingConfig(), "loggers")
    checkpoint: CheckpointConfig = F(CheckpointConfig(), "checkpoints")
    sweep: SweepConfig = F(SweepConfig(), "mesh-shape sweeps (run_recipe --sweep)")
    output_dir: str = F("outputs", "where run folders are written")
    run_name: Optional[str] = F(None, "run folder name; None = <recipe>-<timestamp>")
    seed: int = F(0, "model-init seed; the same seed gives the same weights on every mesh")
    backend: str = F("torch", "torch | jax (the same recipe in JAX: data and tensor parallel, fp32 or bf16)")
    extends: Optional[str] = F(None, "base recipe this one is merged over (path relative to this file)")


def sections() -> dict[str, type]:
    """Section name -> its dataclass, for every section of a Recipe (model, mesh, ...)."""
    return {
        f.name: f.default_factory
        for f in dataclasses.fields(Recipe)
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)
    }


def field_doc(section: str | None, name: str) -> str:
    """The one-line doc of a recipe field (section None = top level)."""
    cls = Recipe if section is None else sections()[section]
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("doc", "")
    raise KeyError(name)
