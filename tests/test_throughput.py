"""Throughput figures: one rule (tokens over time across steady steps) for the summary,
`compare` and sweeps; and the optimizer the trainer builds."""

from __future__ import annotations

import pytest
import torch

from meshforge.configs.schema import OptimizerConfig
from meshforge.experiments.compare import Run
from meshforge.run.observe.record import StepTime, exclusion, steady_throughput, step_times_of_rows
from meshforge.run.train.optim import build_optimizer, fused_unavailable


def test_the_rule_names_what_it_leaves_out_and_counts_tokens_over_time():
    assert [exclusion(n, 2, False, False) for n in (1, 2, 3)] == ["warmup", "warmup", None]
    assert exclusion(3, 2, True, True) == "memory_tracking" and exclusion(3, 2, False, True) == "checkpoint"
    times = [
        StepTime(1, 100, 9.0, "warmup"),
        StepTime(2, 100, 1.0, None),
        StepTime(3, 100, 3.0, "checkpoint"),
        StepTime(4, 100, 0.25, None),
    ]
    s = steady_throughput(times)
    assert s["tokens_per_sec"] == pytest.approx(200 / 1.25)  # not the mean of 100 and 400 tokens/s
    assert s["throughput_steps"] == {"counted": 2, "excluded": {"warmup": [1], "checkpoint": [3]}}
    short = steady_throughput([StepTime(1, 10, 2.0, "warmup"), StepTime(2, 10, 1.0, "warmup")])
    assert short["tokens_per_sec"] == 10 and short["throughput_steps"]["excluded"] == {"warmup": [1]}


def test_compare_applies_the_same_rule_to_the_rows_of_a_run_without_summary():
    rows = [
        {"step": 1, "tokens_per_sec": 10.0, "step_time": 10.0, "tflops_per_device": 1.0},
        {"step": 2, "tokens_per_sec": 100.0, "step_time": 1.0, "tflops_per_device": 10.0},
        {
            "step": 3,
            "tokens_per_sec": 50.0,
            "step_time": 2.0,
            "checkpoint_seconds": 1.0,
            "tflops_per_device": 5,
        },
        {
            "step": 4,
            "tokens_per_sec": 25.0,
            "step_time": 4.0,
            "mem_breakdown/x_max": 1,
            "tflops_per_device": 2.5,
        },
        {"step": 5, "tokens_per_sec": 50.0, "step_time": 2.0, "tflops_per_device": 5.0},
    ]
    times = step_times_of_rows(rows, warmup=1)
    assert [t.excluded for t in times] == ["warmup", None, "checkpoint", "memory_tracking", None]
    info = {"recipe": {"logging": {"warmup_steps": 1}}, "world_size": 2, "summary": {}}
    tp = Run("r", None, info, rows).throughput()
    assert tp["tokens_per_sec"] == pytest.approx(200 / 3) and tp[
        "tokens_per_sec_per_device"
    ] == pytest.approx(100 / 3)
    assert tp["tflops_per_device"] == pytest.approx(0.1 * 200 / 3)  # FLOPs per token from the rows
    with_summary = Run("r", None, {**info, "summary": {"tokens_per_sec": 7.0}}, rows).throughput()
    assert with_summary["tokens_per_sec"] == 7.0  # a finished run's summary covers every step


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
