"""FSDP2 (`fully_shard`): per-block groups plus the root; HSDP and pure replication too.

Each transformer block is one all-gather/reduce-scatter group; the embeddings are one,
and norm + output another (kept unsharded after forward: backward needs them first).
With a 2-D (dp_replicate, dp_shard) mesh this is HSDP; with dp_shard = 1, replication; under
context parallel it shards over dp_shard x cp (the cp ranks' gradients are summed); on one
data-parallel rank without cp it applies only for `cpu_offload` (`fsdp_applies`).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from meshforge.configs.schema import FSDPConfig
from meshforge.core.topology import ParallelDims


@contextlib.contextmanager
def quiet_embedding_view_warning():
    """Silences FSDP2's warning that the wrapped embedding returns a view, within the block (a
    run, an estimator's trace): our blocks add to the embedding's output out of place, so the
    in-place case it warns of never happens. Entered once per run, not per step: entering
    warnings.catch_warnings resets the "once" registries, so other warnings would repeat."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor"
        )
        yield


# float16 trains only under a dynamic loss scale (run/train/loss_scale.py); bfloat16 needs none
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fsdp_units(module: nn.Module) -> int:
    """The FSDP units in `module` (one per fully_shard call; norm + output share one): each runs
    its hooks once per forward and once per backward."""
    return len({id(m._get_fsdp_state()) for m in module.modules() if isinstance(m, FSDPModule)})


def fsdp_applies(dims: ParallelDims, cfg: FSDPConfig) -> bool:
    """FSDP2 wraps the model whenever there is data parallelism, and on one data-parallel
    rank too when its CPU offload is asked for (a 1-rank mesh: the shards are the whole)."""
    return dims.fsdp_enabled or cfg.cpu_offload


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, cfg: FSDPConfig, experts_mesh: DeviceMesh | None = None
) -> None:
    """Per block, the embeddings, norm + output, the root; under expert parallel (`experts_mesh`:
    dp_shard x cp / ep, with dp_replicate for HSDP) each block's experts are their own group over it
    (their ep DTensors become 2-D), as TorchTitan does."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
    # pinned host memory speeds copies to an accelerator only; it needs one (and fake tensors,
    # which the estimator traces on a CPU mesh, cannot pin)
    pin = dp_mesh.device_type == "cuda"
    offload = CPUOffloadPolicy(pin_memory=pin) if cfg.cpu_offload else OffloadPolicy()
    kw = dict(mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    for block in model.layers.values():
        if experts_mesh is not None and hasattr(block, "moe"):
            fully_shard(
                block.moe.experts,
                reshard_after_forward=cfg.reshard_after_forward,
                **{**kw, "mesh": experts_mesh},
            )
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward, **kw)
    tied = model.args.tie_embeddings
    if model.tok_embeddings is not None and not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=cfg.reshard_after_forward, **kw)
    if model.output is not None and not tied:
        fully_shard([model.norm, model.output], reshard_after_forward=False, **kw)
    root = fully_shard(model, reshard_after_forward=False, **kw)  # root: whatever is left (tied weights)
    # gradients are summed, not averaged: the loss is already divided by the global token
    # count (run/train/trainer.py), and on gloo (no AVG) averaging would cost two passes of division
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
