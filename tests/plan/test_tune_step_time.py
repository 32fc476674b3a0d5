"""`meshforge tune`'s step-time model: the timed pipeline against the schedule's own unit-step
simulation, processor sharing, what a profile prices (flops, bytes, ops, links, a GPU's host),
the ranking and tune's tables."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from support import RECIPES
from support.tune_inputs import CPU

from meshforge.core.tables import wide
from meshforge.core.topology import ParallelDims
from meshforge.experiments.tune import rank_predicted
from meshforge.experiments.tune_caveats import batch_caveat
from meshforge.parallelisms.pp_actions import bubble_fraction, parse_action
from meshforge.recipe import load_recipe
from meshforge.simulate.hardware import Link
from meshforge.simulate.profile_toml import load_profile
from meshforge.simulate.schedule import recipe_schedule_order
from meshforge.simulate.step_time import Action, phase_time, predict_step, simulate_timed


@pytest.mark.parametrize("schedule,stages", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)])
def test_unit_actions_time_as_the_schedules_own_simulation(schedule, stages):
    """Every action 1 s and free sends: the timed pipeline is the unit-step one (pp_actions)."""
    recipe = load_recipe(
        str(RECIPES / "debug_cpu.toml"),
        [
            "mesh.dp_shard=1",
            "mesh.tp=1",
            "mesh.pp=4",
            f"pp.schedule={schedule}",
            f"pp.stages_per_rank={stages}",
            "pp.microbatches=8",
            "model.n_layers=8",
        ],
        world_size=None,
    )
    order = recipe_schedule_order(recipe)
    timelines = {
        r: [Action(parse_action(a), 1.0, 0.0) for a in acts if parse_action(a)]
        + [Action((-1, "tail", 0), 0.0, 0.0)]
        for r, acts in order.items()
    }
    ends, busy = simulate_timed(timelines, 0.0, 1, CPU)
    span = max(end for end, _ in ends.values())
    assert span == pytest.approx(max(i + 1 for acts in order.values() for i, a in enumerate(acts) if a))
    assert 1 - sum(busy.values()) / (span * len(order)) == pytest.approx(bubble_fraction(order))


def test_ranks_that_share_cores_share_their_time():
    one = [Action((0, "F", 0), 1.0, 0.0), Action((0, "B", 0), 2.0, 0.5), Action((-1, "tail", 0), 0.25, 0.0)]
    alone, _ = simulate_timed({0: one}, 0.0, 1, CPU)
    assert alone[0][0] == pytest.approx(3.75)
    # 8 ranks of one thread on 2 cores run at a quarter speed; the exposed communication does not slow
    shared = dataclasses.replace(CPU, shared_cores=2)
    ends, _ = simulate_timed({0: one}, 0.0, 8, shared)
    assert ends[0][0] == pytest.approx(4 * 3.25 + 0.5)
    # and slower still by what 8 ranks sharing 2 cores were measured to lose (context switches)
    slowed = dataclasses.replace(shared, sharing_slowdown={4: 1.1, 8: 1.2})
    ends, _ = simulate_timed({0: one}, 0.0, 8, slowed)
    assert ends[0][0] == pytest.approx(1.2 * 4 * 3.25 + 0.5)


def test_a_collective_waits_for_its_groups_last_rank_by_the_computing_since_the_last_one():
    """arrival_skew: an action with collectives on a group waits, after its work, the group size's
    share of the computing wall time since the rank's last collective (a forward without one
    counts toward the backward's), at most the group's arrival_skew_cap; between measured sizes
    linear, a lone rank waits nothing."""
    shared = dataclasses.replace(CPU, shared_cores=2, arrival_skew={2: 0.1, 8: 0.4})
    assert shared.arrival_wait(1, 10.0) == 0.0
    assert shared.arrival_wait(4, 10.0) == pytest.approx(2.0) and shared.arrival_wait(16, 10.0) == 4.0
    timeline = [
        Action((0, "F", 0), 1.0, 0.0),  # no collective: its wall carries over
        Action((0, "B", 0), 2.0, 0.5, group=8),  # waits 0.4 x (F's 4 s + B's 8 s) at a quarter speed
        Action((-1, "tail", 0), 0.25, 0.0, group=2),  # waits 0.1 x its own 1 s
    ]
    ends, _ = simulate_timed({0: timeline}, 0.0, 8, shared)
    assert ends[0][0] == pytest.approx(4 * 3.25 + 0.5 + 0.4 * 12 + 0.1 * 1)
    unskewed = dataclasses.replace(shared, arrival_skew={})
    assert simulate_timed({0: timeline}, 0.0, 8, unskewed)[0][0][0] == pytest.approx(4 * 3.25 + 0.5)
    # the lateness stops growing: B's 4.8 s wait is capped at the 8-group's 3 s, the tail's 0.1
    # stays under the 2-group's 0.5
    capped = dataclasses.replace(shared, arrival_skew_cap={2: 0.5, 8: 3.0})
    assert capped.arrival_wait(4, 10.0) == pytest.approx(0.5 + 2.5 / 3)  # the cap between 2 and 8
    ends, _ = simulate_timed({0: timeline}, 0.0, 8, capped)
    assert ends[0][0] == pytest.approx(4 * 3.25 + 0.5 + 3.0 + 0.1 * 1)


def test_a_ranks_share_of_the_cores_is_slowed_as_measured_between_counts():
    """Up to the cores' count a rank runs as fast as alone; beyond, an equal share of the cores
    divided by the slowdown measured for that many ranks, linear between the counts measured (and
    from 1 at the cores' count), the largest count's beyond them; a GPU's ranks share nothing."""
    cpu = dataclasses.replace(CPU, shared_cores=2, sharing_slowdown={4: 1.1, 8: 1.2})
    assert cpu.core_share(1) == cpu.core_share(2) == 1.0
    assert cpu.core_share(3) == pytest.approx(2 / 3 / 1.05)
    assert cpu.core_share(4) == pytest.approx(2 / 4 / 1.1)
    assert cpu.core_share(6) == pytest.approx(2 / 6 / 1.15)
    assert cpu.core_share(16) == pytest.approx(2 / 16 / 1.2)
    assert dataclasses.replace(cpu, sharing_slowdown={}).core_share(8) == pytest.approx(2 / 8)
    # ranks of 2 threads: 1 rank fills the 2 cores; 2 ranks are a third of the way to the 4 measured
    two_threads = dataclasses.replace(cpu, threads_per_rank=2)
    assert two_threads.core_share(1) == 1.0 and two_threads.core_share(2) == pytest.approx(
        2 / 4 / (1 + 0.1 / 3)
    )
    assert dataclasses.replace(cpu, shared_cores=0).core_share(64) == 1.0
    # a count at or below the cores' (a profile copied to a bigger machine) slows nothing
    bigger = dataclasses.replace(cpu, shared_cores=4)
    assert bigger.core_share(4) == 1.0 and bigger.core_share(6) == pytest.approx(4 / 6 / 1.1)
    # ranks of more threads than cores: alone each used both, so 2 ranks get half of that
    four_threads = dataclasses.replace(cpu, threads_per_rank=4, sharing_slowdown={})
    assert four_threads.core_share(1) == 1.0 and four_threads.core_share(2) == pytest.approx(0.5)


def test_a_profile_names_what_it_does_not_price():
    """A CPU profile calibrated before FSDP's and checkpointing's hooks, core sharing and ranks'
    arrival were measured, and the shipped GPU profiles (their hosts' hooks never measured), say
    what their predictions leave out (checkpointing's only where a step checkpoints)."""
    old = dataclasses.replace(CPU, shared_cores=2, calibrated_world=8)
    assert old.unpriced(8) == [
        "FSDP's hooks per unit (fsdp_unit_overhead_s)",
        "checkpointing's hooks per block (checkpoint_overhead_s)",
        "what ranks sharing the cores lose beyond their share (sharing_slowdown)",
        "a collective's wait for its group's last rank (arrival_skew)",
        "the share of the probes' rates a model's step reaches (model_rate_share)",
    ]
    assert old.unpriced(8, checkpointing=False) == [
        old.unpriced(8)[0],
        *old.unpriced(8)[2:],
    ]  # no AC: not said
    assert len(old.unpriced(2)) == 4  # 2 ranks on 2 cores: no slowdown to share, a pair's wait still
    assert len(old.unpriced(1)) == 3  # one rank: no collective
    new = dataclasses.replace(
        old,
        fsdp_unit_overhead_s=1e-3,
        checkpoint_overhead_s=8e-4,
        sharing_slowdown={4: 1.1, 8: 1.15},
        model_rate_share=0.8,
        arrival_skew={2: 0.05, 4: 0.2, 8: 0.3},
    )
    assert new.unpriced(8) == ["the most that wait grows to (arrival_skew_cap): it grows without bound"]
    new = dataclasses.replace(new, arrival_skew_cap={2: 0.005, 4: 0.03, 8: 0.03})
    assert new.unpriced(8) == []
    assert load_profile("h100").unpriced(8) == [
        "FSDP's hooks per unit (fsdp_unit_overhead_s)",
        "checkpointing's hooks per block (checkpoint_overhead_s)",
    ]
    # refined by measured runs: their fitted rates took the model's share in (no share to measure)
    refined = dataclasses.replace(new, model_rate_share=1.0, source="vm\nrefined by 25 measured runs")
    assert refined.unpriced(8) == []


def test_a_models_step_runs_at_its_calibrated_share_of_the_probes_rates():
    """The arithmetic (matmuls, attention, memory-bound ops) is priced at the share of the probes'
    rates a model's step reached in calibration; the host's work per op is not a rate."""
    cost = {
        "flops": {"float32": 2e9},
        "attention_flops": {"float32": 1e9},
        "memory_bytes": 1e9,
        "ops": 1000,
        "collectives": [],
    }
    cpu = dataclasses.replace(CPU, op_overhead_s=1e-5, attention_flops={"float32": 5e10})
    full = phase_time(cost, cpu, overlap=False)
    arithmetic = 2e9 / 1e9 + 1e9 / 5e10 + 1e9 / 1e9  # CPU: 1 GFLOP/s, 1 GB/s
    assert full.compute_s == pytest.approx(arithmetic + 1000 * 1e-5)
    at_share = phase_time(cost, dataclasses.replace(cpu, model_rate_share=0.8), overlap=False)
    assert at_share.compute_s == pytest.approx(arithmetic / 0.8 + 1000 * 1e-5)
    assert at_share.matmul_s == pytest.approx(full.matmul_s / 0.8)


def test_a_prediction_prices_flops_bytes_ops_and_links():
    cost = {
        "flops": {"float32": 2e9},
        "memory_bytes": 1e9,
        "ops": 1000,
        "dtensor_ops": 500,
        "fsdp_units": 8,
        "checkpointed_blocks": 4,
        "collectives": [["all_reduce", int(1e9), (0, 1), False, 1]],
    }
    work = {"costs": {"0:F0": cost, "1:B0": cost}, "actions": [(0, "F", 0), (0, "B", 0)], "boundary_bytes": 0}
    # CPU ranks (cores shared, enough of them): the host's work adds to the device's
    profile = dataclasses.replace(
        CPU,
        shared_cores=2,
        op_overhead_s=1e-3,
        dtensor_op_overhead_s=2e-3,
        fsdp_unit_overhead_s=0.5,
        checkpoint_overhead_s=0.25,
    )
    p = predict_step({0: work}, ParallelDims(dp_shard=2), 1, profile)
    # per phase: 2 s of matmuls + 1 s of memory + 1 s of ops + 1 s of DTensor dispatch + half of
    # 8 units' hooks (a forward's or a backward's: 2 s) + half of 4 checkpointed blocks' (0.5 s),
    # and an all-reduce of 1 GB on 2 ranks: 1 s
    assert p.step_s == pytest.approx(2 * (7.5 + 1))
    assert p.compute_s == pytest.approx(15) and p.exposed_comm_s == pytest.approx(2) and p.bubble == 0
    assert p.host_s == 0  # in compute: a CPU rank's host is its device


def test_a_logged_steps_gather_is_priced_on_its_share_of_the_steps():
    """The trainer gathers the memory figures on one step in `logging.log_every`: a step carries
    that share of the gather's time (here 1 s of latency each time)."""
    one = {"flops": {}, "memory_bytes": 0, "ops": 0, "dtensor_ops": 0, "collectives": []}
    gather = {**one, "collectives": [["all_gather", 64, (0, 1), False, 1]]}
    profile = dataclasses.replace(CPU, shared_cores=2, links={2: Link(1.0, 1e12)})

    def step(log_every: int) -> float:
        work = {"costs": {"0:F0": one, "log": gather}, "actions": [(0, "F", 0)], "boundary_bytes": 0}
        return predict_step(
            {0: {**work, "log_every": log_every}}, ParallelDims(dp_shard=2), 1, profile
        ).step_s

    assert step(1) == pytest.approx(1.0, rel=1e-6)
    assert step(4) == pytest.approx(0.25, rel=1e-6)


def test_a_gpus_host_runs_ahead_of_it_and_bounds_the_step_only_when_slower():
    """On a GPU (no shared cores) the host's dispatch overlaps the device's work: the step is the
    longer of the two over the whole step, so a model too small to keep the GPU busy (the default
    recipe on an H200: 0.15 ms priced as device work, 22 ms measured) is as fast as its host."""
    cost = {"flops": {"float32": 2e9}, "memory_bytes": 1e9, "ops": 1000, "dtensor_ops": 0, "collectives": []}
    work = {"costs": {"0:F0": cost, "1:B0": cost}, "actions": [(0, "F", 0), (0, "B", 0)], "boundary_bytes": 0}
    gpu = dataclasses.replace(CPU, shared_cores=0, op_overhead_s=1e-3)
    device_bound = predict_step({0: work}, ParallelDims(), 1, gpu)
    assert device_bound.step_s == pytest.approx(2 * 3)  # per phase 2 s matmul + 1 s memory; host 2 s
    host_bound = predict_step({0: work}, ParallelDims(), 1, dataclasses.replace(gpu, op_overhead_s=4e-3))
    assert host_bound.step_s == pytest.approx(2 * 4) and host_bound.compute_s == pytest.approx(6)
    assert host_bound.host_s == host_bound.step_s and device_bound.host_s == pytest.approx(2 * 1)
    # four microbatches without pipelining, two traced: the second's work stands for the later two
    two = {
        "costs": {f"{i}:{k}0": cost for i, k in enumerate("FBFB")},
        "actions": [(0, "F", 0), (0, "B", 0), (0, "F", 1), (0, "B", 1)],
        "boundary_bytes": 0,
    }
    assert predict_step({0: two}, ParallelDims(), 4, gpu).step_s == pytest.approx(4 * 2 * 3)
    host_bound = dataclasses.replace(gpu, op_overhead_s=4e-3)
    assert predict_step({0: two}, ParallelDims(), 4, host_bound).step_s == pytest.approx(4 * 2 * 4)


def test_the_table_shows_a_gpus_host_share_and_no_cpus():
    """tune's table has a host share column where the profile prices a GPU's host apart (the step
    it bounds reads 100%), and none for CPU ranks, whose host work is their compute."""
    from rich.console import Console

    from meshforge.experiments.tune import predicted_table

    def row(label: str, step: float, host: float) -> dict:
        p = {"step_s": step, "host_s": host, "tokens_per_sec_per_device": 1.0, "mfu": None, "bubble": 0.0}
        return {"label": label, "estimate_gib": 1.0, "predicted": {**p, "exposed_comm_s": 0.0}}

    def shown(rows: list[dict]) -> str:
        console = Console(width=200, record=True)
        console.print(predicted_table(rows, CPU, None))
        return console.export_text()

    gpu = shown([row("dp8", 2.0, 2.0), row("tp8", 4.0, 1.0)])
    assert "host share" in gpu
    assert re.search(r"dp8 .*100\.0%", gpu) and re.search(r"tp8 .*25\.0%", gpu), gpu
    assert "host share" not in shown([row("dp2", 2.0, 0.0)])


def test_the_tables_show_each_points_whole_name_in_80_columns():
    """A terminal of 80 columns (and a pipe's) showed four layouts as "dprep2-d…": the point column
    keeps its names whole in both of tune's tables, and the recipe's own is marked."""
    from rich.console import Console

    from meshforge.experiments.tune import confirmed_table, predicted_table

    labels = ["dprep2-dp2-pp2", "dprep2-dp4", "dprep2-dp2-cp2", "dp2-tp2-pp2"]
    p = {
        "step_s": 0.1,
        "tokens_per_sec_per_device": 2779.0,
        "mfu": 0.021,
        "bubble": 0.73,
        "exposed_comm_s": 0.04,
    }
    rows = [
        {
            "label": label,
            "estimate_gib": 0.01,
            "predicted": p,
            "status": "finished",
            "measured": {"step_time": 0.12},
        }
        for label in labels
    ]
    shown = []
    for table in (predicted_table(rows, CPU, None), confirmed_table(rows, own="dp2-tp2-pp2")):
        console = Console(width=80, record=True)
        console.print(table)
        shown.append(console.export_text())
        assert all(re.search(rf"│ {label}\b", shown[-1]) for label in labels), shown[-1]
        assert "…" not in shown[-1], shown[-1]
    assert "dp2-tp2-pp2 *" in shown[1] and "* the recipe's own layout" in shown[1]
    # off a terminal (a pipe, a log file) every table prints at its own width, where it was written to
    piped = io.StringIO()
    wide(Console(file=piped, width=40)).print(predicted_table(rows, CPU, None))
    assert "…" not in piped.getvalue() and all(
        re.search(rf"│ {label}\b", piped.getvalue()) for label in labels
    )


def test_a_pipelines_host_work_repeats_with_its_schedule():
    """Pipelined with 2 microbatches per step, the trainer runs the schedule twice: a host-bound
    GPU step is twice the schedule's host work, plus the tail's once."""
    action = {"flops": {"float32": 1e7}, "memory_bytes": 0, "ops": 1000, "dtensor_ops": 0, "collectives": []}
    tail = {**action, "ops": 500}

    def stage(s: int) -> dict:
        costs = {f"0:F{s}": action, f"1:B{s}": action, "optimizer": tail}
        return {"costs": costs, "actions": [(s, "F", 0), (s, "B", 0)], "boundary_bytes": 0}

    gpu = dataclasses.replace(CPU, shared_cores=0, op_overhead_s=1e-3, links={2: Link(0.0, 1e12)})
    p = predict_step({0: stage(0), 1: stage(1)}, ParallelDims(pp=2), 2, gpu)
    assert p.step_s == pytest.approx(2 * 2 * 1.0 + 0.5)  # the device's 10 ms actions hide behind it


def test_a_pipelines_sends_are_priced_at_the_calibrated_send():
    """Between two stages a forward's output and a backward's gradient each cross once: on the
    critical path of one microbatch, F0 -> F1 -> B1 -> B0, two sends at the profile's own send link
    (calibrate's pairs exchanging tensors), not its collectives' link of 2."""
    action = {"flops": {"float32": 1e9}, "memory_bytes": 0, "ops": 0, "dtensor_ops": 0, "collectives": []}

    def stage(s: int) -> dict:
        costs = {f"0:F{s}": action, f"1:B{s}": action}
        return {"costs": costs, "actions": [(s, "F", 0), (s, "B", 0)], "boundary_bytes": 10**6}

    pooled = dataclasses.replace(CPU, links={2: Link(0.0, 1e12)})
    sending = dataclasses.replace(pooled, kind_links={"send": {2: Link(0.25, 1e6)}})  # 0.25 s + 1 s
    works = {0: stage(0), 1: stage(1)}
    free = predict_step(works, ParallelDims(pp=2), 1, pooled).step_s
    assert free == pytest.approx(4, rel=1e-5)  # four 1 s actions in a row
    assert predict_step(works, ParallelDims(pp=2), 1, sending).step_s == pytest.approx(free + 2 * 1.25)


def test_a_receive_starts_when_both_stages_are_ready_and_a_ranks_own_stage_sends_nothing():
    """gloo's send waits for its receive to be posted: a receiver busy when its input was sent still
    pays the transfer once it is free, and a stage fed by a stage on its own rank (ZBV's V) pays
    none."""

    def forward(stage: int, mb: int, work: float) -> Action:
        return Action((stage, "F", mb), work, 0.0)

    tail = Action((-1, "tail", 0), 0.0, 0.0)
    sender = [forward(0, 0, 1.0), forward(0, 1, 1.0), tail]  # sends at 1 s and 2 s
    # busy until 4.5 s (received at 1-1.5 s): the second input, sent at 2 s, is received at 4.5-5 s
    late = {0: sender, 1: [forward(1, 0, 3.0), forward(1, 1, 1.0), tail]}
    ends, busy = simulate_timed(late, 0.5, 1, CPU)
    assert ends[1][0] == pytest.approx(6.0) and busy[1] == pytest.approx(4.0)  # receiving is not busy
    # stages 1 and 2 on rank 1: stage 2 starts when stage 1 ends
    own = {0: [forward(0, 0, 1.0), tail], 1: [forward(1, 0, 1.0), forward(2, 0, 1.0), tail]}
    assert simulate_timed(own, 0.5, 1, CPU)[0][1][0] == pytest.approx(1.0 + 0.5 + 1.0 + 1.0)
    twice = {0: [forward(0, 0, 1.0), tail], 1: [forward(0, 1, 1.0), tail]}
    with pytest.raises(ValueError, match="stage 0 is on ranks 0 and 1"):
        simulate_timed(twice, 0.5, 1, CPU)


def test_points_that_train_on_different_batches_are_ranked_by_tokens_per_second():
    """llm_8b fixes the micro batch, so dp8 x tp2 trains on 8x the tokens of cp2 x tp8 per step:
    ranked by step time, the slower layout came first (predicted 2,103 vs 4,515 tokens/s/device)."""

    def row(label, step_s, tokens):
        predicted = {
            "step_s": step_s,
            "tokens_per_step": tokens,
            "tokens_per_sec_per_device": tokens / step_s / 16,
        }
        return {"label": label, "status": "planned", "predicted": predicted}

    rows = [
        row("cp2-tp8", 0.24, 8192),
        row("dp8-tp2", 0.91, 8 * 8192),
        row("big", 0.1, 1),
        row("dp2", 0.6, 16384),
    ]
    rows.append({"label": "tp16", "status": "skipped"})
    assert [r["label"] for r in rank_predicted(rows)] == ["dp8-tp2", "cp2-tp8", "dp2", "big"]
    assert "1 to 65,536 tokens per step" in batch_caveat(rank_predicted(rows))
    same = [row("a", 1.0, 4096), row("b", 0.5, 4096)]
    assert [r["label"] for r in rank_predicted(same)] == ["b", "a"] and batch_caveat(same) is None
