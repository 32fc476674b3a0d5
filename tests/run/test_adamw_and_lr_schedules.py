"""The optimizer the trainer builds: fused AdamW where torch has the kernel, the fallbacks and why;
and the lr schedule's two conventions (TorchTitan's and DeepSpeed's)."""

from __future__ import annotations

import math

import pytest
import torch
from support import RECIPES

from meshforge.configs import RecipeError
from meshforge.configs.schema import LRSchedulerConfig, OptimizerConfig
from meshforge.recipe import load_recipe
from meshforge.run.train.optim import build_optimizer, fused_unavailable, lr_multiplier


def test_adamw_is_fused_where_torch_has_the_kernel_and_says_why_not_elsewhere(caplog):
    cfg = OptimizerConfig()
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    assert build_optimizer(params, cfg).defaults["fused"] is True  # the CPU kernel too
    assert build_optimizer(params, cfg, "foreach").defaults["foreach"] is True
    loop = build_optimizer(params, cfg, "for-loop").defaults
    assert not loop["fused"] and loop["foreach"] is False
    ints = [torch.zeros(3, dtype=torch.int64)]
    assert "int64" in fused_unavailable(ints)
    meta = [torch.nn.Parameter(torch.randn(2, device="meta"))]
    with caplog.at_level("WARNING"):
        opt = build_optimizer(meta, cfg)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    assert "no fused AdamW kernel for meta tensors" in caplog.text


def test_fused_and_for_loop_adamw_take_the_same_step():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64, 32)), None
    b = torch.nn.Parameter(a.detach().clone())
    for p, impl in ((a, "fused"), (b, "for-loop")):
        opt = build_optimizer([p], OptimizerConfig(lr=1e-2), impl)
        for i in range(3):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
            opt.step()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_dtensors_mixed_with_plain_parameters_fall_back_from_fused(caplog):
    """TP without sequence parallel leaves the norms as plain tensors beside DTensor weights:
    one fused (or foreach) call cannot take both, so AdamW runs its per-tensor loop."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        params = [
            torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])),
            torch.nn.Parameter(torch.randn(4)),
        ]
        with caplog.at_level("WARNING"):
            opt = build_optimizer(params, OptimizerConfig())
        assert not opt.defaults["fused"] and opt.defaults["foreach"] is False
        assert "DTensor and plain parameters mixed" in caplog.text
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()  # the step the fused kernel refused
        assert fused_unavailable(params[:1]) is None
    finally:
        dist.destroy_process_group()


def test_deepspeed_convention_by_hand():
    """DeepSpeed's formulas at hand-computed points (deepspeed/runtime/lr_schedules.py, 0.19):
    step s runs at iteration i = s - 1; W = max(2, warmup_steps)."""
    cos = LRSchedulerConfig(warmup_steps=4, warmup_shape="log", decay="cosine", min_lr_ratio=0.0)
    cos.convention = "deepspeed"
    got = [lr_multiplier(s, 10, cos) for s in range(12)]
    # i=-1: WarmupCosineLR's 0; i=0..3: log(i+1)/log(4); i=4..: (1 + cos(pi (i-3)/6)) / 2, then 0
    want = [0.0, 0.0, 0.5, math.log(3) / math.log(4), 1.0, 0.9330127019, 0.75, 0.5, 0.25, 0.0669872981]
    assert got == pytest.approx(want + [0.0, 0.0], abs=1e-9)
    lin = LRSchedulerConfig(warmup_steps=1, warmup_start=0.2, decay="linear", min_lr_ratio=0.2)
    lin.convention = "deepspeed"
    # W = 2 (not 1): i=-1 and 0 at the min, i=1 halfway; then (T - i) / (T - W) of the way down from the peak
    got = [lr_multiplier(s, 6, lin) for s in range(9)]
    assert got == pytest.approx([0.2, 0.2, 0.6, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    # TorchTitan's convention is unchanged: (s+1)/W, then decay from step W
    tt = LRSchedulerConfig(warmup_steps=2, decay="linear", min_lr_ratio=0.0)
    assert [lr_multiplier(s, 4, tt) for s in range(5)] == [0.5, 1.0, 1.0, 0.5, 0.0]


def test_a_log_warmup_outside_deepspeed_s_convention_is_refused():
    overrides = ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1", "lr_scheduler.warmup_shape=log"]
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPES / "debug_cpu.toml", overrides, world_size=1)
    assert "lr_scheduler.warmup_shape = 'log'" in str(e.value) and "convention=deepspeed" in str(e.value)
