"""The training loop's sections: [train], [optimizer], [lr_scheduler], [loss_scale]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

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
class SGDConfig:
    momentum: float = F(0.9, "SGD momentum (torch.optim.SGD's); 0 = plain SGD")
    nesterov: bool = F(False, "Nesterov momentum (needs momentum > 0)")
    dampening: float = F(0.0, "SGD dampening of the gradient added to the momentum")


@dataclass
class LionConfig:
    betas: List[float] = F(
        [0.9, 0.99],
        "Lion's betas: beta1 interpolates the update's sign, beta2 the momentum (Chen et al. 2023)",
    )


@dataclass
class MuonConfig:
    momentum: float = F(0.95, "Muon momentum (torch.optim.Muon's)")
    nesterov: bool = F(True, "Nesterov momentum before orthogonalising")
    ns_steps: int = F(5, "Newton-Schulz iterations")
    ns_coefficients: List[float] = F(
        [3.4445, -4.7750, 2.0315], "the quintic Newton-Schulz coefficients a, b, c"
    )
    eps: float = F(1e-7, "floor of the norm the update is divided by before Newton-Schulz")
    ns_dtype: str = F(
        "bfloat16", "dtype Newton-Schulz runs in: bfloat16 (torch.optim.Muon's, Keller Jordan's) | float32"
    )
    adjust_lr: str = F(
        "original",
        "lr of a matrix A x B: original (lr * sqrt(max(1, A/B)), Keller Jordan's) | match_rms_adamw "
        "(lr * 0.2 * sqrt(max(A, B)), Moonlight's: AdamW's lr and weight decay carry over)",
    )
    adamw_lr: float = F(
        0.0,
        "lr of the parameters Muon leaves to AdamW (embeddings, norms, output, router, biases); "
        "0 = optimizer.lr. AdamW's betas, eps and implementation come from [optimizer]",
    )


@dataclass
class OptimizerConfig:
    name: str = F("adamw", "optimizer: adamw | sgd | lion | muon; each reads its own section below")
    lr: float = F(3e-4, "peak learning rate")
    betas: List[float] = F([0.9, 0.95], "AdamW betas (Muon's AdamW part reads them too)")
    eps: float = F(1e-8, "AdamW epsilon (Muon's AdamW part reads it too)")
    weight_decay: float = F(0.1, "decoupled weight decay (SGD: L2 added to the gradient, as torch.optim.SGD)")
    implementation: str = F(
        "fused",
        "AdamW: fused (one kernel per step; foreach where a parameter cannot) | foreach | for-loop "
        "(Muon's AdamW part reads it too)",
    )
    no_decay: List[str] = F(
        [], "kinds of parameters without weight decay: any of embedding, output, router, norm, bias, matrix"
    )
    lr_multipliers: Dict[str, float] = F(
        {}, "lr multiplier per kind of parameter, e.g. {embedding = 0.5}; kinds as in no_decay"
    )
    sgd: SGDConfig = F(SGDConfig(), "optimizer.name = sgd: torch.optim.SGD")
    lion: LionConfig = F(LionConfig(), "optimizer.name = lion: the sign update of Chen et al. 2023")
    muon: MuonConfig = F(
        MuonConfig(),
        "optimizer.name = muon: Newton-Schulz orthogonalised momentum on hidden matrices, AdamW elsewhere",
    )


# the kinds of parameter optimizer.no_decay and optimizer.lr_multipliers name (a "matrix" is a hidden one)
PARAM_KINDS = ("embedding", "output", "router", "norm", "bias", "matrix")

# the [optimizer] fields besides name/lr/weight_decay each optimizer reads; its own section is read too
OPTIMIZER_READS = {
    "adamw": ("betas", "eps", "implementation"),
    "sgd": ("sgd",),
    "lion": ("lion",),
    "muon": ("betas", "eps", "implementation", "muon"),
}


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = F(0, "warmup steps from warmup_start to lr")
    warmup_shape: str = F(
        "linear", "how the lr rises in warmup: linear | log (DeepSpeed's default; needs convention=deepspeed)"
    )
    warmup_start: float = F(0.0, "the lr warmup starts from, as a fraction of the peak lr")
    decay: str = F("cosine", "decay after warmup: cosine | linear | sqrt (1 - sqrt(progress)) | constant")
    decay_ratio: Optional[float] = F(
        None,
        "warmup-stable-decay (TorchTitan's lr_scheduler.decay_ratio): decay over the last round(steps * "
        "decay_ratio) steps (at most those after warmup), the lr at its peak before; null = decay from "
        "the end of warmup (convention = torchtitan only)",
    )
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
