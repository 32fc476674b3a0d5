"""The recipe schema: one dataclass per section, each field with a one-line doc, in a module per
group of sections (model.py, parallelism.py, activation_checkpoint.py, training.py, data.py,
records.py, sweep.py); `Recipe` here composes them.

TOML recipes are only data; the schema is the single source of truth for what a recipe
may say, its defaults, and (through `field_doc`) the help that `meshforge explain` shows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .activation_checkpoint import ActivationCheckpointConfig
from .data import DataConfig, EvalConfig
from .fields import F
from .model import ModelConfig
from .parallelism import CompileConfig, CPConfig, Float8Config, FSDPConfig, MeshConfig, PPConfig, TPConfig
from .records import CheckpointConfig, LoggingConfig, ProfileConfig
from .sweep import SlurmConfig, SweepConfig
from .training import LossScaleConfig, LRSchedulerConfig, OptimizerConfig, TrainConfig

# every section's dataclass, importable from here whichever module of its group holds it
__all__ = [
    "ActivationCheckpointConfig",
    "CPConfig",
    "CheckpointConfig",
    "CompileConfig",
    "DataConfig",
    "EvalConfig",
    "FSDPConfig",
    "Float8Config",
    "LRSchedulerConfig",
    "LoggingConfig",
    "LossScaleConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PPConfig",
    "ProfileConfig",
    "Recipe",
    "SlurmConfig",
    "SweepConfig",
    "TPConfig",
    "TrainConfig",
    "field_doc",
    "sections",
]


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
