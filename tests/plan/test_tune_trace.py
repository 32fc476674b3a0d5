"""`meshforge tune`'s trace: the work it records (op_costs) against the model's own arithmetic and
a real step's dispatched ops, the FSDP units and checkpointed blocks it counts, and its
extrapolation of a deep stage against the full trace. (Split from the tune tests by what they
test: the step-time model is in test_tune_step_time.py, the command in test_tune_command.py.)"""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
from support import RECIPES
from support.tune_inputs import LAYOUTS, debug

from meshforge.configs import ac_policy
from meshforge.configs.schema import ActivationCheckpointConfig
from meshforge.experiments.grid import Point
from meshforge.experiments.tune_caveats import checkpoints
from meshforge.models import args_from_config, get_model_spec
from meshforge.parallelisms.ac import apply_ac, checkpointed_blocks
from meshforge.recipe import load_recipe
from meshforge.run.observe.memory import LOGGED_FIGURES, rank_memory
from meshforge.run.observe.memtrace import make_tracker, peak_categories
from meshforge.run.train.optim import build_optimizer
from meshforge.run.train.step import cross_entropy_sum
from meshforge.simulate.estimate import Extrapolated, _grow_collectives, submit_trace, trace_pool
from meshforge.simulate.op_costs import CostRecorder
from meshforge.simulate.trace import _allocate_moments, _step_once_per_shape, trace_rank


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
