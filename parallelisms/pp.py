"""Pipeline parallelism: split the model into stages by layers and build a torch schedule.

A stage is a copy of the (meta-device) model with the other stages' layers deleted and,
off the first/last stage, tok_embeddings / norm+output set to None, so parameter names
(`layers.7.attention.wq.weight`) are the same as in the whole model.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _PipelineSchedule,
    get_schedule_class,
)

from meshforge.configs.schema import PPConfig
from meshforge.core.errors import Problem, nearest
from meshforge.core.topology import divisors
from meshforge.models.common.moe import moe_layers, uncounted

# The schedule families torch ships, by how stages sit on ranks
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")  # one stage per rank
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")  # looped virtual stages
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank, first and last on rank 0
# schedules that split backward into input- and weight-gradient passes
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES + V_SCHEDULES


def check_pipeline(cfg: PPConfig, pp: int, n_layers: int, local_batch: int) -> list[Problem]:
    """The schedule's rules for `pp` ranks, `n_layers` layers and a local batch of
    `local_batch` samples; resolves microbatches = -1 (one per stage) in place."""
    if pp == 1:
        return []
    problems = []
    stages = pp * cfg.stages_per_rank
    if cfg.schedule in SINGLE_STAGE_SCHEDULES and cfg.stages_per_rank != 1:
        problems.append(
            Problem(
                "pp.stages_per_rank",
                cfg.stages_per_rank,
                f"{cfg.schedule} runs one stage per rank; set 1, or use Interleaved1F1B for virtual stages",
            )
        )
    if cfg.schedule in V_SCHEDULES and cfg.stages_per_rank != 2:
        problems.append(
            Problem(
                "pp.stages_per_rank",
                cfg.stages_per_rank,
                f"{cfg.schedule} is a V schedule: it needs exactly 2 stages per rank",
            )
        )
    if cfg.layers_per_stage is not None:
        counts = cfg.layers_per_stage
        if len(counts) != stages or sum(counts) != n_layers or min(counts) < 0:
            problems.append(
                Problem(
                    "pp.layers_per_stage",
                    counts,
                    f"needs {stages} non-negative counts "
                    f"(pp x stages_per_rank) summing to n_layers={n_layers}",
                )
            )
    elif n_layers < stages:
        problems.append(
            Problem(
                "mesh.pp",
                pp,
                f"{stages} pipeline stages but only {n_layers} layers; "
                f"valid pp x stages_per_rank <= {n_layers}",
            )
        )
    if cfg.microbatches == -1:
        cfg.microbatches = stages
    mb = cfg.microbatches
    if mb < 1:
        problems.append(Problem("pp.microbatches", mb, "must be >= 1"))
    elif local_batch % mb:
        problems.append(
            Problem(
                "pp.microbatches",
                mb,
                f"must divide the local batch train.micro_batch_size="
                f"{local_batch}; valid: {nearest(mb, divisors(local_batch))}",
            )
        )
    if cfg.schedule == "DualPipeV" and mb < stages:
        problems.append(
            Problem("pp.microbatches", mb, f"DualPipeV needs microbatches >= stages = pp x 2 = {stages}")
        )
    elif cfg.schedule in ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble") and mb < pp:
        problems.append(Problem("pp.microbatches", mb, f"{cfg.schedule} needs microbatches >= pp={pp}"))
    if cfg.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and mb % pp:
        problems.append(Problem("pp.microbatches", mb, f"{cfg.schedule} needs a multiple of pp={pp}"))
    return problems


def stage_layout(n_layers: int, n_stages: int, cfg: PPConfig) -> list[list[int]]:
    """Layer ids per stage: explicit `layers_per_stage`, else balanced with the embedding
    and output counted as `embedding_weight` / `output_weight` layers."""
    if cfg.layers_per_stage is not None:
        bounds = [0, *itertools.accumulate(cfg.layers_per_stage)]
        return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]
    per_stage = (n_layers + cfg.embedding_weight + cfg.output_weight) / n_stages
    layout: list[list[int]] = [[] for _ in range(n_stages)]
    for i in range(n_layers):
        center = cfg.embedding_weight + i + 0.5  # the layer's middle, in layer units
        layout[min(int(center // per_stage), n_stages - 1)].append(i)
    return layout


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Looped assignment (rank r holds r, r+pp, ...); V schedules hold r and 2pp-1-r."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_model(model: nn.Module, layers: list[int], is_first: bool, is_last: bool) -> nn.Module:
    """A copy of `model` holding only `layers` (and the embeddings/head if first/last)."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if not is_first:
        stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
    return stage


def pipeline_split(
    model: nn.Module, pp_mesh: DeviceMesh, cfg: PPConfig
) -> tuple[list[nn.Module], list[int], list[list[int]]]:
    """This rank's stage modules, their stage ids, and the whole layout (for logging)."""
    pp = pp_mesh.size()
    n_stages = pp * cfg.stages_per_rank
    layout = stage_layout(len(model.layers), n_stages, cfg)
    ids = stage_ids_for_rank(pp_mesh.get_local_rank(), pp, cfg.stages_per_rank, cfg.schedule)
    parts = [split_model(model, layout[s], s == 0, s == n_stages - 1) for s in ids]
    return parts, ids, layout


def build_schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    pp_mesh: DeviceMesh,
    cfg: PPConfig,
    device: torch.device,
    loss_fn: Callable,
) -> _PipelineSchedule:
    """The torch schedule over this rank's stages. Gradients are not divided by the
    microbatch count (scale_grads=False): the loss is already normalised by the global
    number of target tokens, so summed microbatch gradients equal the 1-rank ones."""
    n_stages = pp_mesh.size() * cfg.stages_per_rank
    stages = [
        PipelineStage(part, stage_idx, n_stages, device, group=pp_mesh.get_group())
        for part, stage_idx in zip(parts, stage_ids)
    ]
    for stage in stages:
        if moe_layers(stage.submod):  # the shape inference's forwards are no step's: MoE keeps no stats
            for name in ("_prepare_forward_infra", "_prepare_backward_infra"):
                setattr(stage, name, _uncounted(getattr(stage, name)))
    cls = get_schedule_class(cfg.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=False)


def _uncounted(method: Callable) -> Callable:
    def run(*args, **kwargs):
        with uncounted():
            return method(*args, **kwargs)

    return run


def bubble_fraction_gpipe(pp: int, microbatches: int) -> float:
    """Idle fraction of an ideal GPipe/1F1B step: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (microbatches + pp - 1) if microbatches else math.nan
