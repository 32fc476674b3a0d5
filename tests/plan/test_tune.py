"""`meshforge tune`: the traced work (op_costs) against the model's own arithmetic, its
extrapolation against the full trace, the timed pipeline against the schedule's own unit-step
simulation, processor sharing, and the command end to end."""

from __future__ import annotations

import dataclasses
import io
import json
import re

import numpy as np
import pytest
import torch
import torch._functorch.config as functorch_config
from support import QUICK, RECIPES, run_cli, slurm_env

from meshforge.configs import ac_policy
from meshforge.configs.schema import ActivationCheckpointConfig
from meshforge.core.tables import wide
from meshforge.core.topology import ParallelDims
from meshforge.experiments.grid import Point
from meshforge.experiments.tune import rank_predicted
from meshforge.experiments.tune_caveats import batch_caveat, checkpoints, untraced_caveats, untraced_reason
from meshforge.models import args_from_config, get_model_spec
from meshforge.parallelisms.ac import apply_ac, checkpointed_blocks
from meshforge.parallelisms.pp_actions import bubble_fraction, parse_action
from meshforge.recipe import load_recipe
from meshforge.run.observe import wandb_files as wf
from meshforge.run.observe.memory import LOGGED_FIGURES, rank_memory
from meshforge.run.observe.memtrace import make_tracker, peak_categories
from meshforge.run.train.optim import build_optimizer
from meshforge.run.train.step import cross_entropy_sum
from meshforge.simulate.core_sharing import counts_to_measure
from meshforge.simulate.estimate import Extrapolated, _grow_collectives, submit_trace, trace_pool
from meshforge.simulate.hardware import Link, Profile
from meshforge.simulate.op_costs import CostRecorder
from meshforge.simulate.profile_toml import SHIPPED, load_profile, save_profile
from meshforge.simulate.schedule import recipe_schedule_order
from meshforge.simulate.step_time import Action, phase_time, predict_step, simulate_timed
from meshforge.simulate.trace import _allocate_moments, _step_once_per_shape, trace_rank

ONE = ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1", "train.global_batch_size=4"]
# fsdp2 also as a recipe that leaves the device to the machine and logs every 5th step
FSDP2 = ["mesh.dp_shard=2", "train.global_batch_size=8", "train.device=auto", "logging.log_every=5"]
LAYOUTS = {"one": [], "tp2": ["mesh.tp=2"], "fsdp2": FSDP2}


def debug(*overrides: str):
    return load_recipe(str(RECIPES / "debug_cpu.toml"), [*ONE, *overrides], world_size=None)


@pytest.fixture(scope="module")
def works():
    """Rank 0's traced work on one process, TP 2 and FSDP 2 (one pool: the traces run at once)."""
    with trace_pool() as pool:
        futures = {name: pool.submit(trace_rank, debug(*o), 0) for name, o in LAYOUTS.items()}
        return {name: f.result()["work"] for name, f in futures.items()}


def matmul_params(recipe) -> int:
    """Parameters that take part in a matmul: all but the input embedding (a lookup) and norms."""
    with torch.device("meta"):
        model = get_model_spec(recipe.model.name).build(args_from_config(recipe.model))
    return sum(
        p.numel() for n, p in model.named_parameters() if "norm" not in n and "tok_embeddings" not in n
    )


def test_a_forward_counts_the_models_matmul_and_attention_flops(works):
    r = debug()
    a = args_from_config(r.model)
    tokens = r.train.global_batch_size * r.train.seq_len
    # 2 FLOPs per matmul weight per token; attention apart (its own rate): QK^T and PV over the
    # whole (unmasked) sequence
    matmuls = tokens * 2 * matmul_params(r)
    attention = tokens * 4 * a.n_layers * a.n_heads * a.head_dim * r.train.seq_len
    forward = works["one"]["costs"]["0:F0"]
    assert forward["flops"] == {"float32": matmuls} and forward["attention_flops"] == {"float32": attention}
    assert forward["collectives"] == []  # one process: nothing to say to anyone
    backward = works["one"]["costs"]["1:B0"]
    assert backward["flops"]["float32"] == 2 * matmuls  # dgrad + wgrad
    assert 2 * attention <= backward["attention_flops"]["float32"] <= 3 * attention  # it recomputes
    # every matmul and every head is split over TP 2, so a TP rank does exactly half
    tp_forward = works["tp2"]["costs"]["0:F0"]
    assert tp_forward["flops"] == {"float32": matmuls / 2}
    assert tp_forward["attention_flops"] == {"float32": attention / 2}


def test_the_trace_counts_the_ops_and_bytes_a_real_step_dispatches(works):
    """The same forward and backward on real tensors, counted by the same recorder: the same ops,
    FLOPs and bytes. (A fake tensor's `tensor.device`, asked by autograd, reaches the recorder as
    an op where a real tensor's is an attribute: counted, it was ~70% of a trace's ops.)"""
    recipe = debug()
    args = args_from_config(recipe.model)
    torch.manual_seed(0)
    model = get_model_spec(recipe.model.name).build(args)
    model.init_buffers(torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (2, recipe.train.global_batch_size, recipe.train.seq_len))
    where = {"phase": "0:F0"}
    with CostRecorder(lambda: where["phase"]) as recorder:
        loss = cross_entropy_sum(model(tokens[0]), tokens[1])
        where["phase"] = "1:B0"
        loss.backward()
    real, traced = recorder.result(), works["one"]["costs"]
    for phase in ("0:F0", "1:B0"):
        assert real[phase]["ops"] == traced[phase]["ops"], phase
        assert real[phase]["flops"] == traced[phase]["flops"], phase
        assert real[phase]["memory_bytes"] == pytest.approx(traced[phase]["memory_bytes"], rel=1e-6), phase


def test_the_traced_optimizer_step_once_per_shape_peaks_as_every_parameter():
    """The trace steps one parameter of each shape (trace._step_once_per_shape) for the step's
    memory: the same peak by category as stepping every one, where the previous parameter's `denom`
    is still alive beside the next one's temporaries (w2 after w1: its peak is w1 + 2 x w2)."""
    recipe = debug()

    def peak(once: bool):
        torch.manual_seed(0)
        model = get_model_spec(recipe.model.name).build(args_from_config(recipe.model))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt = build_optimizer(model.parameters(), recipe.optimizer, implementation="for-loop")
        _allocate_moments([opt])
        with make_tracker([model], [opt]) as tracker:
            _step_once_per_shape(opt) if once else opt.step()
        return peak_categories(tracker)

    once, every = peak(True), peak(False)
    assert once == every and once["optimizer"] > 0


def test_the_optimizer_is_priced_as_the_run_steps_it(works):
    """The optimizer phase's work is the run's own AdamW step (fused: one op over every parameter,
    reading and writing each parameter, gradient and moment), counted on real tensors by the same
    recorder, not the for-loop step the trace runs for its memory (~12 ops per parameter)."""
    recipe = debug()
    model = get_model_spec(recipe.model.name).build(args_from_config(recipe.model))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = build_optimizer(model.parameters(), recipe.optimizer)
    assert opt.defaults["fused"], "debug_cpu steps with fused AdamW"
    _allocate_moments([opt])
    with CostRecorder(lambda: "optimizer") as recorder:
        opt.step()
    real, traced = recorder.result()["optimizer"], works["one"]["costs"]["optimizer"]
    assert traced["ops"] == real["ops"] == 2  # the step counters' increment, the fused kernel
    assert traced["memory_bytes"] == pytest.approx(real["memory_bytes"], rel=1e-6)
    params = sum(4 * p.numel() for p in model.parameters())  # float32
    # parameters, gradients and both moments read; all but the gradients written; the step counters
    assert 7 * params < traced["memory_bytes"] < 7.01 * params
    # under FSDP the same two, the kernel one DTensor op over every sharded parameter: the for-loop
    # step traced for the memory (~12 DTensor ops per parameter) is not priced
    sharded = works["fsdp2"]["costs"]["optimizer"]
    assert (sharded["ops"], sharded["dtensor_ops"]) == (2, 1)
    assert sharded["memory_bytes"] == pytest.approx(traced["memory_bytes"] / 2, rel=0.01)


def test_a_foreach_op_counts_the_lists_it_updates_as_read_and_written():
    a, b = torch.zeros(1000), torch.zeros(3000)
    with CostRecorder(lambda: "p") as recorder:
        torch._foreach_add_([a, b], 1.0)  # returns nothing: its schema says it writes self
        torch._foreach_mul_([a, b], [a, b])  # self written, the other list read
    assert recorder.result()["p"]["memory_bytes"] == 4 * (2 + 3) * 4000


def test_fsdp_traffic_is_the_parameters_once_each_way(works):
    params_bytes = 4 * sum(p.numel() for p in _meta_model(debug()).parameters())
    costs = works["fsdp2"]["costs"]

    def traffic(kind: str, phases) -> int:
        return sum(c[1] * c[4] for p in phases for c in costs[p]["collectives"] if c[0] == kind)

    assert traffic("all_gather", ["0:F0"]) == params_bytes  # the forward gathers every parameter
    assert traffic("reduce_scatter", list(costs)) == params_bytes  # the gradients go back once
    fsdp = [c for p in costs if p not in ("sync", "log") for c in costs[p]["collectives"]]
    assert {tuple(c[2]) for c in fsdp} == {(0, 1)}  # the dp_shard group
    assert all(c[3] for c in fsdp)  # FSDP's own: overlappable
    # between backward and optimizer, what the trainer waits on: the token count over dp, the
    # gradient norm over the shards (one partial norm per parameter, stacked), the loss and stop
    # flag over every rank (2 floats); each once, blocking
    n_params = len(list(_meta_model(debug()).parameters()))
    sync = sorted((c[0], c[1], tuple(c[2]), c[3], c[4]) for c in costs["sync"]["collectives"])
    assert sync == [("all_reduce", n, (0, 1), False, 1) for n in sorted((4, 4 * n_params, 8))]
    # a logged step gathers every rank's memory figures (float64; rank_memory's, this machine's
    # CPU ones) over the world, blocking; it is priced on one step in logging.log_every
    assert len(rank_memory(torch.device("cpu"), 0)) == LOGGED_FIGURES["cpu"] == 4
    assert costs["log"]["collectives"] == [["all_gather", 2 * 4 * 8, (0, 1), False, 1]]
    assert works["fsdp2"]["log_every"] == 5


def test_each_forward_and_backward_counts_the_fsdp_units_it_runs(works):
    """FSDP2's hooks cost the host per unit each time a unit runs forward or backward: debug_cpu's
    units are its 4 blocks, the embeddings, norm + output (one fully_shard call) and the root. No
    units where FSDP does not wrap the model, and none outside the forwards and backwards."""
    units = args_from_config(debug().model).n_layers + 3
    fsdp = works["fsdp2"]["costs"]
    assert (fsdp["0:F0"]["fsdp_units"], fsdp["1:B0"]["fsdp_units"]) == (units, units) == (7, 7)
    assert all(fsdp[p]["fsdp_units"] == 0 for p in ("sync", "log", "optimizer") if p in fsdp)
    assert all(c["fsdp_units"] == 0 for name in ("one", "tp2") for c in works[name]["costs"].values())
    # no AC in these: no block's checkpointing hooks
    assert all(c["checkpointed_blocks"] == 0 for w in works.values() for c in w["costs"].values())


def test_a_pipeline_stage_counts_its_own_fsdp_units_and_checkpointed_blocks():
    """Under pp each stage's actions count that stage's units: stage 0 one block, the embeddings and
    its root; stage 1 three blocks, norm + output and its root; once per microbatch each. Under full
    AC each forward and backward also counts the stage's blocks, each checkpointed."""
    recipe = debug(
        "mesh.dp_shard=2",
        "mesh.pp=2",
        "pp.layers_per_stage=[1,3]",
        "train.global_batch_size=8",
        "activation_checkpoint.mode=full",
    )
    with trace_pool() as pool:
        first, last = (pool.submit(trace_rank, recipe, r) for r in (0, 2))  # pp is the outermost dim
        stages = {0: first.result()["work"], 1: last.result()["work"]}
    for stage, units, blocks in ((0, 3, 1), (1, 5, 3)):
        actions = stages[stage]["actions"]
        costs = [stages[stage]["costs"][f"{i}:{k}{s}"] for i, (s, k, _) in enumerate(actions)]
        assert [c["fsdp_units"] for c in costs] == [units] * len(actions)
        assert [c["checkpointed_blocks"] for c in costs] == [blocks] * len(actions)
        assert len(actions) == 2 * recipe.pp.microbatches


@pytest.mark.parametrize(
    "mode, every, stage_layers, want",
    [
        ("none", 1, 4, 0),
        ("memory_budget", 1, 4, 0),  # compile's partitioner recomputes: no wrapper, no hooks
        ("full", 1, 4, 4),
        ("op", 1, 4, 4),
        ("selective", 2, 4, 2),  # layers 0 and 2
        ("selective", 3, 4, 2),  # layers 0 and 3
        ("selective", 2, 3, 1),  # a later pipeline stage's layers 1-3: layer 2, by its id
    ],
)
def test_the_checkpointed_blocks_counted_are_those_apply_ac_wraps(mode, every, stage_layers, want):
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.build(spec.flavors["debug"])
    for layer_id in list(model.layers)[: 4 - stage_layers]:  # a stage keeps the ids of its layers
        del model.layers[layer_id]
    cfg = ac_policy(ActivationCheckpointConfig(mode=mode, selective_every=every))
    plain = {layer_id: block.forward for layer_id, block in model.layers.items()}
    try:
        apply_ac(model, cfg)
    finally:
        functorch_config.activation_memory_budget = 1.0  # process-wide under memory_budget
    wrapped = sum(block.forward != plain[layer_id] for layer_id, block in model.layers.items())
    assert checkpointed_blocks(model, cfg) == wrapped == want


def test_a_tune_checkpoints_where_its_recipe_or_a_point_does():
    none, full = (
        load_recipe(RECIPES / "debug_cpu.toml", [f"activation_checkpoint.mode={m}"]) for m in ("none", "full")
    )
    plain = Point("dp8", {"dp_shard": 8}, {})
    with_ac = Point("dp8-mode=selective", {"dp_shard": 8}, {"activation_checkpoint.mode": "selective"})
    assert (
        not checkpoints(none, [plain]) and checkpoints(full, [plain]) and checkpoints(none, [plain, with_ac])
    )


def test_tp_collectives_are_blocking_on_the_tp_group(works):
    forward = works["tp2"]["costs"]["0:F0"]["collectives"]
    assert forward and {(c[0], tuple(c[2]), c[3]) for c in forward} <= {
        ("all_gather", (0, 1), False),
        ("reduce_scatter", (0, 1), False),
        ("all_reduce", (0, 1), False),
    }


def test_dtensor_ops_are_counted_where_tp_runs_them(works):
    """TP's forward runs on DTensors (each op pays DTensor's host dispatch on top of its local ops);
    one process none, and FSDP's forward none (it computes on the all-gathered plain tensors) but
    its optimizer step on the sharded DTensor parameters."""
    costs = {name: w["costs"] for name, w in works.items()}
    assert all(c["dtensor_ops"] == 0 for c in costs["one"].values())
    assert costs["tp2"]["0:F0"]["dtensor_ops"] > 0 and costs["tp2"]["1:B0"]["dtensor_ops"] > 0
    assert costs["fsdp2"]["0:F0"]["dtensor_ops"] == 0 and costs["fsdp2"]["optimizer"]["dtensor_ops"] > 0
    # TP's local ops: the one-process forward's, on shards, plus its redistributions' copies
    assert costs["one"]["0:F0"]["ops"] <= costs["tp2"]["0:F0"]["ops"] < 2 * costs["one"]["0:F0"]["ops"]


def test_refining_a_profile_recovers_measured_steps():
    """`--calibrate-from`'s fit: steps 'measured' on a machine 2x slower at matmuls, 3x at host
    work per op and 4x at link latency than the profile says, which the profile alone misses by
    40% or more: the fitted profile halves every run's error at least, and misses the median run
    by under 10% (not 0: the pull towards the calibrated constants weighs against the runs' mean
    square, and soft L1 counts the largest misses less than squared)."""
    from meshforge.experiments.refine import MeasuredRun, fit_factors, scaled

    layouts = {**LAYOUTS, "pp2": ["mesh.pp=2"], "fsdp2_tp2": ["mesh.dp_shard=2", "mesh.tp=2"]}
    with trace_pool() as pool:
        traces = {}
        for name, o in layouts.items():
            recipe = debug(*o)
            dims = ParallelDims.from_config(recipe.mesh)
            traces[name] = (
                dims,
                {dims.coordinate(r)["pp"]: pool.submit(trace_rank, recipe, r) for r in dims.role_ranks()},
            )
        traced = {n: (d, {pp: f.result()["work"] for pp, f in t.items()}) for n, (d, t) in traces.items()}
    profile = dataclasses.replace(
        CPU, op_overhead_s=1e-5, dtensor_op_overhead_s=3e-5, links={2: Link(5e-4, 1e9)}, kind_links={}
    )
    truth = {
        "matmul": 0.5,
        "memory": 1.0,
        "op_host": 3.0,
        "dtensor_host": 1.0,
        "latency": 4.0,
        "bandwidth": 1.0,
    }
    machine = scaled(profile, truth)
    runs = [MeasuredRun(n, w, d, 1, predict_step(w, d, 1, machine).step_s, 1) for n, (d, w) in traced.items()]
    before = [abs(r.predict(profile) / r.step_s - 1) for r in runs]
    factors = fit_factors(runs, profile)
    after = [abs(r.predict(scaled(profile, factors)) / r.step_s - 1) for r in runs]
    assert min(before) > 0.4, before
    assert all(a <= b / 2 for a, b in zip(after, before)) and sorted(after)[2] < 0.1, (before, after, factors)
    # the runs weigh as one against the pull: three copies of each run move no constant further
    tripled = fit_factors(runs * 3, profile)
    assert all(abs(tripled[k] / factors[k] - 1) < 0.02 for k in factors), (tripled, factors)


def test_the_fits_soft_l1_residuals_square_to_scipys_loss():
    """refine._soft_l1(m)^2 is scipy's soft_l1 of the miss at ROBUST_SCALE: ~m^2 for small misses,
    growing linearly for large ones (a layout missed by 60% weighs ~12x one missed by 10%, not 36x)."""
    from meshforge.experiments.refine import ROBUST_SCALE, _soft_l1

    m = np.array([-0.6, -0.1, -1e-9, 0.0, 1e-9, 0.01, 0.1, 0.6])
    c = ROBUST_SCALE
    assert np.allclose(_soft_l1(m) ** 2, c * c * 2 * (np.sqrt(1 + (m / c) ** 2) - 1), rtol=1e-9, atol=1e-18)
    assert np.allclose(_soft_l1(-m), -_soft_l1(m)) and abs(_soft_l1(np.array([1e-9]))[0] / 1e-9 - 1) < 1e-6
    assert 10 < (_soft_l1(np.array([0.6])) / _soft_l1(np.array([0.1])))[0] ** 2 < 15


def test_a_refined_profiles_file_name_takes_no_quotes():
    """A GPU's calibrated profile is named for its device ("NVIDIA H200"): the refined file's name
    has no space a shell would split on, and keeps what names it."""
    from meshforge.experiments.refine import profile_file_stem

    assert profile_file_stem("NVIDIA H200+runs") == "NVIDIA-H200+runs"
    assert profile_file_stem("vm-01.local+runs") == "vm-01.local+runs"
    assert profile_file_stem("a / b (c)") == "a-b-c"


def _meta_model(recipe):
    with torch.device("meta"):
        return get_model_spec(recipe.model.name).build(args_from_config(recipe.model))


def test_collectives_grow_in_count_or_in_bytes_with_depth():
    """Traced at two depths a period apart, extrapolated two periods past the first: a block's
    all-gathers grow in count; the gradient norm's all-reduce (a float per parameter) grows in
    bytes, paired with its twin on the same group; one that appears only deeper starts from 0; a
    shrinking size is not paired."""

    def line(a: float, b: float) -> float:
        return max(0.0, a + (b - a) * 2)  # as extrapolate_work's

    low = [
        ["all_gather", 64, (0, 1), True, 4],
        ["all_reduce", 40, (0, 1), False, 1],
        ["broadcast", 8, (0,), False, 1],
    ]
    high = [
        ["all_gather", 64, (0, 1), True, 5],
        ["all_reduce", 48, (0, 1), False, 1],
        ["all_to_all", 16, (0, 1), False, 1],
    ]
    grown = sorted(_grow_collectives(low, high, line))
    assert grown == [
        ["all_gather", 64, (0, 1), True, 6],
        ["all_reduce", 56, (0, 1), False, 1],  # 40 -> 48 -> 56 bytes, still once
        ["all_to_all", 16, (0, 1), False, 2],  # only in the deeper trace: 0 -> 1 -> 2
        ["broadcast", 8, (0,), False, 0],  # gone from the deeper trace
    ]
    shrinking = _grow_collectives(
        [["all_reduce", 48, (0, 1), False, 1]], [["all_reduce", 40, (0, 1), False, 1]], line
    )
    assert sorted(shrinking) == [["all_reduce", 40, (0, 1), False, 2], ["all_reduce", 48, (0, 1), False, 0]]


def test_a_deep_stage_extrapolates_to_its_full_trace_work():
    recipe = debug(
        "model.n_layers=12", "mesh.dp_shard=2", "train.global_batch_size=8", "activation_checkpoint.mode=full"
    )
    with trace_pool() as pool:
        shallow = submit_trace(recipe, 0, pool, work=True)
        assert isinstance(shallow, Extrapolated)  # 12 layers: traced at 4 and 5, extrapolated
        full = pool.submit(trace_rank, recipe, 0).result()["work"]["costs"]
        grown = shallow.result()["work"]["costs"]
    assert grown.keys() == full.keys()
    assert any(c["attention_flops"] for c in full.values())
    for phase, cost in full.items():
        keys = (
            "flops",
            "attention_flops",
            "memory_bytes",
            "ops",
            "dtensor_ops",
            "fsdp_units",
            "checkpointed_blocks",
        )
        for key in keys:
            assert grown[phase][key] == pytest.approx(cost[key], rel=1e-12), (phase, key)
        want = {tuple(c[:-1]): c[-1] for c in cost["collectives"]}
        got = {tuple(c[:-1]): c[-1] for c in grown[phase]["collectives"] if c[-1]}
        assert got == pytest.approx(want), phase


CPU = Profile(
    name="test",
    source="made up for the test",
    matmul_flops={"float32": 1e9},
    memory_Bps=1e9,
    ranks_per_node=8,
    shared_cores=0,
    links={2: Link(0.0, 1e9)},
)


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


def test_a_tune_says_when_the_recipe_asks_what_the_eager_trace_does_not_model():
    """On one H200 tune predicted compiled llm_1b 11-16% long, float8 68-97% long and CPU offload
    85% short: the table says so, and refuses them as axes."""
    recipe, dp = str(RECIPES / "debug_cpu.toml"), ["mesh.tp=1", "mesh.pp=1", "mesh.dp_shard=2"]
    assert untraced_caveats(load_recipe(recipe, dp)) == []
    (compiled,) = untraced_caveats(load_recipe(recipe, [*dp, "compile.enabled=true"]))
    assert compiled.startswith("compile.enabled = true: each step is predicted as eager")
    budget = [*dp, "compile.enabled=true", "activation_checkpoint.mode=memory_budget"]
    assert [line.split(":")[0] for line in untraced_caveats(load_recipe(recipe, budget))] == [
        "compile.enabled = true",
        "activation_checkpoint.mode = memory_budget",
    ]
    offload = untraced_caveats(load_recipe(recipe, [*dp, "fsdp.cpu_offload=true"]))
    assert offload == [
        "fsdp.cpu_offload = true: step times are not to be trusted: the host's optimizer step and the "
        "copies to and from it are not modelled"
    ]
    (per_op,) = untraced_caveats(load_recipe(recipe, [*dp, "activation_checkpoint.mode=op"]))
    assert per_op.startswith("activation_checkpoint.mode = op: priced as full AC's hooks per block")
    by_op = Point("dp2-mode=op", {"dp_shard": 2}, {"activation_checkpoint.mode": "op"})
    assert untraced_caveats(load_recipe(recipe, dp), [by_op]) == [per_op]  # a point's mode, as an axis
    # an MoE block's checkpointing hooks are priced at a dense block's: said where a point checkpoints
    moe = load_recipe(RECIPES / "qwen3_30b_a3b.toml", ["activation_checkpoint.mode=none"])
    no_ac = Point("dp8", {"dp_shard": 8}, {})
    assert untraced_caveats(moe, [no_ac]) == []
    (moe_ac,) = untraced_caveats(
        moe, [no_ac, Point("dp8-full", {"dp_shard": 8}, {"activation_checkpoint.mode": "full"})]
    )
    assert moe_ac.startswith("checkpointed MoE blocks: their hooks are priced at a dense block's")
    moe_full = load_recipe(RECIPES / "qwen3_30b_a3b.toml")  # its own mode: full
    assert untraced_caveats(moe_full) == [moe_ac]
    none_axis = [Point(f"dp8-{m}", {"dp_shard": 8}, {"activation_checkpoint.mode": "none"}) for m in "ab"]
    assert untraced_caveats(moe_full, none_axis) == []  # every point overrides the recipe's full
    # a profile without checkpointing's price (a shipped GPU one) says so in its own line instead
    assert untraced_caveats(moe_full, block_hooks_priced=False) == []
    (float8,) = untraced_caveats(load_recipe(recipe, [*dp, "float8.enabled=true"]))
    assert float8.startswith("float8.enabled = true: step times are not to be trusted: float8's matmuls")
    # as axes they are refused (a key, a float8.* key by its prefix, the budget among AC modes)
    for key, values in [
        ("float8.exclude", ["[output]", "[]"]),
        ("float8.enabled", ["true", "false"]),
        ("fsdp.cpu_offload", ["true", "false"]),
        ("compile.enabled", ["true", "false"]),
        ("activation_checkpoint.mode", ["full", "memory_budget"]),
    ]:
        assert untraced_reason(key, values), key
    assert untraced_reason("activation_checkpoint.mode", ["none", "full", "op"]) is None
    assert untraced_reason("fsdp.reshard_after_forward", ["true", "false"]) is None


@pytest.mark.slow
def test_a_tune_plan_says_an_moe_blocks_checkpointing_hooks_are_priced_as_a_dense_blocks(tmp_path):
    """The shrunk Qwen3 MoE recipe (its own AC: full) over 2 ranks with a profile that prices
    checkpointing's hooks: tune says, under its table, that an MoE block's are priced short."""
    priced = tmp_path / "priced.toml"
    text = SHIPPED["h100"].read_text()
    priced.write_text(text.replace("checkpoint_overhead_s = 0.0", "checkpoint_overhead_s = 1e-4"))
    # as the recipe's header shrinks it for 8 CPU processes
    shrunk = "model.n_layers=2 model.dim=128 model.n_heads=4 model.n_kv_heads=2 model.head_dim=32 "
    shrunk += "model.moe_dim=64 model.num_experts=16 model.vocab_size=1024 train.seq_len=128"
    args = ["tune", str(RECIPES / "qwen3_30b_a3b.toml"), "--world", "2", "--plan", "--profile", str(priced)]
    axis = ["--axis", "activation_checkpoint.mode=none,full"]
    proc = run_cli(
        [*args, *axis, *shrunk.split(), "fsdp.param_dtype=float32"], cwd=tmp_path, program="meshforge"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert "checkpointed MoE blocks: their hooks are priced at a dense block's" in said, proc.stdout
    # piped, the table is as wide as it needs: in rich's 80 columns its step cells read "0.041…"
    assert "…" not in proc.stdout and re.search(r"│ cp2-ep2-mode=full\s+│ 0\.\d{3,}", proc.stdout), (
        proc.stdout
    )
    assert "does not price FSDP's hooks per unit" in said and "checkpointing's hooks" not in said


def test_a_tune_plan_says_when_layouts_change_the_global_batch(tmp_path):
    """A fixed micro batch (2 sequences of 32 tokens): dp2 trains on twice the tokens of tp2 per step."""
    batch = ["train.global_batch_size=-1", "train.micro_batch_size=2", "train.grad_accum_steps=1"]
    args = ["tune", str(RECIPES / "debug_cpu.toml"), "--world", "2", "--plan", "--profile", "h100"]
    proc = run_cli([*args, *QUICK, *batch], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "highest tokens/s first" in proc.stdout
    assert "train on 64 to 128 tokens per step" in " ".join(proc.stdout.split()), proc.stdout
    # the shipped profile never measured its host's FSDP hooks: said before the table
    said = " ".join(proc.stdout.split())
    assert "profile h100 does not price FSDP's hooks per unit" in said
    assert "--calibrate --world 1 --profile-out gpu.toml` on a GPU node" in said  # what a GPU can run
    # 4 of the 5 layouts of 2 ranks ranked; pp2 refused (its 4 microbatches need 4 samples), said so
    assert re.search(r"^predicted 4 of 5 points in \d+ s \(1 refused\)$", proc.stdout, re.MULTILINE)


def test_bad_tune_input_is_refused_naming_it(tmp_path):
    recipe = str(RECIPES / "debug_cpu.toml")
    proc = run_cli(
        ["tune", recipe, "--world", "2", "--plan", "--profile", "h10"], cwd=tmp_path, program="meshforge"
    )
    assert (
        proc.returncode == 2 and "did you mean h100?" in proc.stderr and "shipped: h100, h200" in proc.stderr
    )
    proc = run_cli(
        [
            "tune",
            recipe,
            "--world",
            "2",
            "--plan",
            "--profile",
            "h100",
            "--axis",
            "compile.enabled=true,false",
        ],
        cwd=tmp_path,
        program="meshforge",
    )
    assert (
        proc.returncode == 2 and "--axis compile.enabled" in proc.stderr and "trace runs eager" in proc.stderr
    )
    assert "in the recipe" not in proc.stderr  # an axis is the command line's
    bad = tmp_path / "p.toml"
    bad.write_text(SHIPPED["h100"].read_text().replace("memory_Bps", "memory_bps"))
    proc = run_cli(
        ["tune", recipe, "--world", "2", "--plan", "--profile", str(bad)], cwd=tmp_path, program="meshforge"
    )
    assert proc.returncode == 2 and "memory_bps" in proc.stderr and "did you mean memory_Bps?" in proc.stderr
    assert "problem(s) in the recipe" not in proc.stderr
    missing = tmp_path / "no-such-sweep"  # a typo in --calibrate-from is named, not skipped
    proc = run_cli(
        ["tune", recipe, "--world", "2", "--plan", "--profile", "h100", "--calibrate-from", str(missing)],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 2 and f"--calibrate-from {missing}: no such folder" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """`meshforge tune` end to end on 2 ranks: calibrate this machine, predict every layout, run
    the best predicted and the recipe's own (dp2) as Slurm jobs (support/fake_slurm.py runs them here),
    W&B offline."""
    out = tmp_path_factory.mktemp("tune")
    args = [
        "tune",
        str(RECIPES / "debug_cpu.toml"),
        "--world",
        "2",
        "--top",
        "1",
        "--calibrate",
        "--profile-out",
        str(out / "profile.toml"),
        "mesh.dp_shard=2",
        "mesh.tp=1",
        "mesh.pp=1",
        *QUICK,
        "sweep.steps=5",
        f"output_dir={out}",
        "logging.wandb=true",
        "logging.wandb_mode=offline",
        "sweep.launcher=slurm",
        "sweep.slurm.poll_s=0.5",
    ]
    proc = run_cli(args, cwd=out, program="meshforge", timeout=900, env=slurm_env(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow
def test_tune_predicts_confirms_and_writes_the_winner(tuned):
    out, stdout = tuned
    folder = out / "tune-debug_cpu-w2"
    rows = {r["label"]: r for r in map(json.loads, (folder / "tune.jsonl").read_text().splitlines())}
    assert set(rows) == {"dprep2", "dp2", "cp2", "tp2", "pp2"}  # every layout of 2 ranks
    planned = [r for r in rows.values() if r["status"] != "skipped" and "predicted" in r]
    assert len(planned) == 5 and all(r["predicted"]["step_s"] > 0 for r in planned)
    assert rows["pp2"]["predicted"]["bubble"] > 0 and rows["dp2"]["predicted"]["bubble"] == 0
    best = max(planned, key=lambda r: r["predicted"]["tokens_per_sec_per_device"])
    confirmed = {label for label, r in rows.items() if "measured" in r}
    assert confirmed == {best["label"], "dp2"}  # the top 1 and the recipe's own
    jobs = [json.loads(line) for line in (folder / "confirm.jsonl").read_text().splitlines()]
    assert {r["label"] for r in jobs if r["status"] == "queued"} == confirmed  # each one a Slurm job
    assert all((folder / "jobs" / f"{label}.sbatch").is_file() for label in confirmed)
    for label in confirmed:
        assert rows[label]["status"] == "finished" and rows[label]["measured"]["step_time"] > 0
        assert f"{label}" in stdout
    assert "predicted vs measured" in stdout and "fastest measured:" in stdout
    winner = max(confirmed, key=lambda label: rows[label]["measured"]["tokens_per_sec"])
    recipe = load_recipe(str(folder / "tune-best.toml"), [], world_size=2)
    assert ParallelDims.from_config(recipe.mesh).label() == winner
    assert load_profile(out / "profile.toml").calibrated_world == 2
    (table_run,) = wf.run_files(folder)  # the predicted-vs-measured table, as W&B wrote it offline
    assert wf.run_record(table_run).job_type == "tune-summary"


@pytest.mark.slow
def test_the_tunes_calibration_measured_plausible_numbers(tuned, tmp_path):
    """The profile `--calibrate` measured for the tune (2 ranks, the cores split between them): rates
    in range, one link per group size, a collective dearer for more bytes, and the file round-trips."""
    out, stdout = tuned
    profile = load_profile(out / "profile.toml")
    assert 1e8 < profile.matmul_rate("float32") < 1e13 and profile.matmul_rate("bfloat16") > 0
    # flash attention on a CPU: slower than the matmuls, not by orders of magnitude in fp32
    assert sorted(profile.attention_flops) == ["bfloat16", "float32"]
    assert 0.05 < profile.attention_rate("float32") / profile.matmul_rate("float32") < 2
    assert profile.memory_Bps > 0 and 0 < profile.op_overhead_s < profile.fsdp_unit_overhead_s < 0.1
    assert profile.op_overhead_s < profile.checkpoint_overhead_s < 0.1 and "per checkpointed block" in stdout
    # 2 ranks on this machine's cores: sharing measured only where they outnumber the cores
    assert set(profile.sharing_slowdown) == set(counts_to_measure(2, 1, profile.shared_cores))
    assert 0.3 < profile.model_rate_share < 1.2 and profile.unpriced(2) == []
    assert "model rate share" in stdout  # its row in the printed table
    # the pair's wait for its last rank, a share and its bound, measured and printed
    assert list(profile.arrival_skew) == list(profile.arrival_skew_cap) == [2]
    assert profile.arrival_skew_cap[2] < 0.25 and "that wait at most" in stdout
    assert list(profile.links) == [2] and profile.calibrated_world == 2 and profile.shared_cores >= 1
    link = profile.link(2, False)
    assert 0 <= link.latency_s < 0.1 and link.bandwidth_Bps > 0
    assert profile.collective_time("all_gather", 4 << 20, 2) > profile.collective_time(
        "all_gather", 4 << 10, 2
    )
    save_profile(profile, tmp_path / "again.toml")
    assert load_profile(tmp_path / "again.toml") == profile
    assert "hardware profile" in stdout and "calibrated in" in stdout  # its summary, on the terminal


@pytest.mark.slow
def test_calibrate_from_refines_the_profile_by_the_tunes_runs(tuned, tmp_path):
    """`--calibrate-from` the tune's folder: its 2 measured points traced again and fitted, the fit
    printed run by run, the refined profile written where the next tune reads it, then used."""
    out, _ = tuned
    args = [
        "tune",
        str(RECIPES / "debug_cpu.toml"),
        "--world",
        "2",
        "--plan",
        "--profile",
        str(out / "profile.toml"),
    ]
    proc = run_cli(
        [*args, *QUICK, "--calibrate-from", str(out / "tune-debug_cpu-w2")], cwd=tmp_path, program="meshforge"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = load_profile(out / "profile.toml")
    (written,) = tmp_path.glob("meshforge-profile-*+runs.toml")
    refined = load_profile(written)
    assert refined.name == f"{base.name}+runs" and "refined by 2 measured runs" in refined.source
    assert f"profile {base.name} refined by 2 runs" in proc.stdout and "factors: matmul x" in proc.stdout
    assert f"profile {refined.name}" in proc.stdout  # the tune then predicts with it
    # the fit moved the constants: not every rate as it was
    assert (refined.matmul_flops, refined.op_overhead_s) != (base.matmul_flops, base.op_overhead_s)
