"""The optimizer the trainer builds: fused AdamW where torch has the kernel, the fallbacks and why."""

from __future__ import annotations

import torch

from meshforge.configs.schema import OptimizerConfig
from meshforge.run.train.optim import build_optimizer, fused_unavailable


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
