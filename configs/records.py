"""What a run writes and watches: [logging], [checkpoint], [profile]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .fields import NO_SAVE, NO_WANDB, F, unread_with


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
