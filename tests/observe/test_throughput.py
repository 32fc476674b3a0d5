"""Throughput figures: one rule (tokens over time across steady steps) for the summary,
`compare` and sweeps."""

from __future__ import annotations

import pytest
import torch

from meshforge.experiments.compare import Run
from meshforge.run.observe.record import StepTime, exclusion, steady_throughput, step_times_of_rows


def test_the_rule_names_what_it_leaves_out_and_counts_tokens_over_time():
    assert [exclusion(n, 2, tracked=False, saved=False) for n in (1, 2, 3)] == ["warmup", "warmup", None]
    assert exclusion(3, 2, tracked=True, saved=True) == "memory_tracking"
    assert exclusion(3, 2, tracked=False, saved=True) == "checkpoint"
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
            "mem_breakdown/total_gib": 0.5,
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


def test_fp32_mfu_is_against_the_plain_fp32_peak_tf32_being_off(monkeypatch):
    """torch keeps fp32 matmuls fp32 (TF32 off) and meshforge never turns TF32 on, so a fp32
    run is held to the GPU's CUDA-core fp32 peak: 67 TFLOP/s on an H100 SXM, not TF32's 494.5."""
    from meshforge.run.observe import flops

    monkeypatch.setattr(flops.torch.cuda, "get_device_name", lambda d: "NVIDIA H100 80GB HBM3")
    assert not torch.backends.cuda.matmul.allow_tf32
    assert flops.gpu_peak_flops(torch.device("cuda", 0), "float32") == 67e12
    assert flops.gpu_peak_flops(torch.device("cuda", 0), "bfloat16") == 989e12
    monkeypatch.setattr(flops.torch.cuda, "get_device_name", lambda d: "NVIDIA A100-SXM4-80GB")
    assert flops.gpu_peak_flops(torch.device("cuda", 0), "float32") == 19.5e12


def test_cpu_peak_is_one_ranks_share_of_the_cores(monkeypatch):
    """Rank 0 measures the matmul rate alone with its threads; 8 one-thread ranks on 2 cores
    each get a quarter of that, one process with both cores all of it."""
    from meshforge.run.observe import flops
    from meshforge.run.rank.distributed import DistEnv

    monkeypatch.setattr(flops, "measure_cpu_matmul_flops", lambda dtype: 40e9)
    monkeypatch.setattr(flops.os, "sched_getaffinity", lambda pid: {0, 1})  # the cores this process may use
    monkeypatch.setattr(flops.torch, "get_num_threads", lambda: 1)
    eight = DistEnv(rank=0, local_rank=0, world_size=8, local_world_size=8, device=torch.device("cpu"))
    assert flops.device_peak_flops(eight, "float32") == 40e9 * 2 / 8
    monkeypatch.setattr(flops.torch, "get_num_threads", lambda: 2)
    one = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    assert flops.device_peak_flops(one, "float32") == 40e9
    assert flops.cpu_share(ranks_on_host=4, threads=4, cores=16) == 1.0  # enough cores: nothing shared
    assert flops.cpu_share(ranks_on_host=2, threads=8, cores=4) == 0.5  # 16 threads asked of 4 cores


def test_the_cpu_peak_is_the_fastest_operand_layout(monkeypatch):
    """A training step's matmuls take their operands transposed or not (the forward A @ B^T, the
    weight gradient A^T @ B, the input gradient A @ B), and a CPU's bf16 kernels differ by 10-17x
    between these: the MFU peak is measured in the fastest of them (A @ B alone made a bf16 run's
    MFU 199%). The timings are given here, so the choice is tested, not this machine's clock."""
    from meshforge.run.observe import flops

    per_256 = {(False, False): 9.0, (False, True): 1.0, (True, False): 0.5, (True, True): 3.0}  # seconds

    def product_of(n: int, layout: tuple[bool, bool]):
        def product():
            return None

        product.seconds = per_256[layout] * (n / 256) ** 3
        return product

    assert flops.measure_cpu_matmul_flops(sizes=(64,), dtype=torch.bfloat16) > 0  # real products run
    monkeypatch.setattr(flops, "_best_seconds", lambda product, repeats: product.seconds)
    assert flops.peak_matmul_flops(product_of, sizes=(256, 512)) == 2 * 256**3 / 0.5
