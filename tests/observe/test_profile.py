"""The profiler: the steps a recipe names run under torch.profiler, each rank writes a trace, and the
profiled steps' time is split into compute, communication, pipeline send/receive, data and optimizer
(read from the trace), logged and summarised; the split's interval arithmetic on its own."""

from __future__ import annotations

import json

import pytest
from support import QUICK, RECIPES, read_metrics, run_recipe

from meshforge.configs import RecipeError
from meshforge.recipe import load_recipe
from meshforge.run.observe.profile import DATA, OPTIMIZER, PARTS, breakdown, union_length

MAIN = 1  # the step's thread
STEP = [(0.0, 1000.0, MAIN)]  # one step of 1000 us


def test_overlapping_intervals_count_once():
    assert union_length([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def test_on_a_host_timeline_a_collective_outside_operators_is_exposed_and_the_rest_is_compute():
    events = [
        ("aten::mm", 0, 300, False, MAIN),
        ("gloo:all_reduce", 300, 500, False, MAIN),
        ("c10d::allreduce_", 300, 520, False, MAIN),  # nested around the gloo op: counted once, to 520
        ("gloo:recv", 600, 700, False, MAIN),
        (DATA, 900, 950, False, MAIN),
        (OPTIMIZER, 950, 1000, False, MAIN),
    ]
    parts = breakdown(events, STEP)
    assert parts == pytest.approx(
        {
            "communication_s": 220e-6,
            "pipeline_p2p_s": 100e-6,
            "data_s": 50e-6,
            "optimizer_s": 50e-6,
            "compute_s": 580e-6,
        }
    )
    assert sum(parts.values()) == pytest.approx(1000e-6)


def test_on_a_device_timeline_only_communication_no_kernel_hides_is_exposed():
    events = [
        ("ampere_sgemm", 0, 400, True, 7),
        ("ncclDevKernel_AllGather_RING_LL", 200, 600, True, 8),  # 200-400 overlapped by the matmul
        ("ncclDevKernel_SendRecv", 700, 800, True, 8),
        ("aten::mm", 0, 10, False, MAIN),  # host launches: not the device's timeline
        (OPTIMIZER, 900, 1000, False, MAIN),
    ]
    parts = breakdown(events, STEP)
    assert parts["communication_s"] == pytest.approx(200e-6) and parts["pipeline_p2p_s"] == pytest.approx(
        100e-6
    )
    assert parts["optimizer_s"] == pytest.approx(100e-6) and parts["compute_s"] == pytest.approx(600e-6)


def test_on_a_host_timeline_an_asynchronous_op_is_exposed_only_while_the_thread_waits():
    """A gloo op's interval is its work's lifetime: a pipeline's send issued before the backward
    spans it, and an all-gather on gloo's own thread runs while the step's thread computes. Only
    the thread's time outside its operators, with the op in flight, is theirs; a collective wait
    held inside an operator (DTensor's) is exposed."""
    events = [
        ("aten::mm", 0, 200, False, MAIN),
        ("gloo:send", 150, 650, False, MAIN),  # issued inside the forward, done after the wait below
        ("aten::mm", 250, 600, False, MAIN),
        ("aten::linear", 620, 800, False, MAIN),  # a DTensor op: its redistribution waits inside it
        ("_c10d_functional::wait_tensor", 700, 760, False, MAIN),
        ("gloo:all_gather", 300, 900, False, 2),  # on gloo's thread: waited for from 800
        ("aten::copy_", 820, 880, False, 2),  # gloo's thread copying: not the step thread's compute
        ("## Call CompiledFxGraph abc ##", 880, 900, False, MAIN),  # a compiled graph computes
        (OPTIMIZER, 950, 1000, False, MAIN),
    ]
    parts = breakdown(events, STEP)
    # the thread is outside its operators (or in the wait) at 200-250, 600-620, 700-760, 800-880 and
    # 900-950: the send alone is in flight at 200-250; a collective (which counts first) at 600-620,
    # 700-760 and 800-880; nothing at 900-950 (host work outside operators: compute)
    assert parts["pipeline_p2p_s"] == pytest.approx(50e-6)
    assert parts["communication_s"] == pytest.approx(160e-6)
    assert parts["compute_s"] == pytest.approx(740e-6) and sum(parts.values()) == pytest.approx(1000e-6)


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["profile.start_step=29", "profile.steps=3"], "profile.start_step", "end after train.steps=30"),
        (["profile.start_step=1", "profile.steps=2"], "profile.start_step", "memory_breakdown_step=2"),
        (["profile.start_step=5", "profile.memory_snapshot=true"], "profile.memory_snapshot", "CUDA"),
        (["profile.steps=0"], "profile", "steps >= 1"),
    ],
)
def test_profiles_that_cannot_be_taken_are_refused(overrides, field, words):
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPES / "debug_cpu.toml", overrides, world_size=8)
    found = [p for p in e.value.problems if p.field == field]
    assert found and words in str(found[0]), e.value.problems


@pytest.mark.slow
def test_a_profiled_pipeline_run_writes_a_trace_per_rank_and_splits_its_steps(tmp_path):
    """dp 2 x pp 2 (4 ranks), steps 3-4 profiled: a Chrome trace per rank holding those steps, the
    split (slowest rank per part) logged at step 4 and in the summary, the parts adding up to the
    profiled steps' time, and those steps left out of the throughput."""
    args = [
        str(RECIPES / "debug_cpu.toml"),
        *QUICK,
        "mesh.dp_shard=2",
        "mesh.tp=1",
        "mesh.pp=2",
        "train.steps=6",
        "profile.start_step=3",
        f"output_dir={tmp_path}",
        "run_name=prof",
    ]
    proc = run_recipe(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "prof"
    for rank in range(4):
        trace = json.loads((run / "profile" / f"rank{rank}.pt.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"meshforge/step3", "meshforge/step4", DATA, OPTIMIZER} <= names
    rows = {r["step"]: r for r in read_metrics(run)}
    assert "profile/active" in rows[3] and "profile/active" in rows[4] and "profile/active" not in rows[5]
    parts = {k: rows[4][f"profile/{k}"] for k in PARTS}
    assert parts["communication_s"] > 0 and parts["pipeline_p2p_s"] > 0 and parts["compute_s"] > 0
    # each part is the slowest rank's, so their sum can pass one rank's step, not the two steps' time
    assert sum(parts.values()) <= rows[3]["step_time"] + rows[4]["step_time"]
    summary = json.loads((run / "run.json").read_text())["summary"]
    assert summary["profile_compute_s"] == parts["compute_s"]
    assert "profiling" in json.dumps(summary["throughput_steps"])
