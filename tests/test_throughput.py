"""Throughput figures: one rule (tokens over time across steady steps) for the summary,
`compare` and sweeps."""

from __future__ import annotations

import pytest

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
