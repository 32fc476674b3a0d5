"""The training loop's sections: [train], [optimizer], [lr_scheduler], [loss_scale]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from .fields import F


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
