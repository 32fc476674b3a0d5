"""The host's work per op, timed on models too small for their arithmetic to count: what
`meshforge tune --calibrate` prices each op (each op on DTensors, each FSDP unit's and each
checkpointed block's hooks) of a traced step at; the median timing both it and calibrate.py's
rates use; and a Llama's step timed with what CostRecorder counts in it (rate_probes' reference
Llama is stepped by it too)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshforge.configs import ACPolicy
from meshforge.configs.schema import FSDPConfig
from meshforge.models.llama3.model import LlamaArgs, Transformer
from meshforge.parallelisms.ac import apply_ac, checkpointed_blocks
from meshforge.parallelisms.fsdp import apply_fsdp, fsdp_units
from meshforge.simulate.op_costs import CostRecorder, PhaseCost

WARMUP, REPEATS = 2, 7
PROBE_ROUNDS = 3  # rounds of each probe of one rank alone, the fastest kept


def median_seconds(op: Callable[[], object], device: str = "cpu", calls: int = 1) -> float:
    """Seconds per call of `op`: the median of REPEATS timings of `calls` calls each, after WARMUP
    untimed ones. On a GPU each timing waits for the device (kernels launch ahead of it), so
    `calls` > 1 keeps that wait's own cost out of short ops."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(WARMUP):
        op()
    sync()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(calls):
            op()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def tiny_stack() -> torch.nn.Module:
    """Layers too small for their arithmetic to count: what is timed is the host's work per op."""
    layers = [
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8), torch.nn.SiLU()) for _ in range(16)
    ]
    return torch.nn.Sequential(*layers)


def training_step(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """A forward and backward of `model` on `x`."""
    return lambda: model(x).sum().backward()


def tiny_step(device: str = "cpu") -> Callable[[], None]:
    """A forward and backward of tiny_stack: calibrate's compute burst between two collectives, and
    the price of the DTensor probe's local ops (its blocks are of the same plain layers)."""
    return training_step(tiny_stack().to(device), torch.randn(2, 8, device=device))


def cost_of(step: Callable[[], None]) -> PhaseCost:
    """What CostRecorder counts in one run of `step`."""
    recorder = CostRecorder(lambda: "step")
    with recorder:
        step()
    return recorder.phases["step"]


def seconds_and_cost(step: Callable[[], None], device: str = "cpu") -> tuple[float, PhaseCost]:
    """The median seconds of `step`, and what CostRecorder counts in it."""
    cost = cost_of(step)
    return median_seconds(step, device), cost


TINY_LLAMA = LlamaArgs(
    dim=16, n_layers=4, n_heads=2, n_kv_heads=1, vocab_size=16, multiple_of=8, max_seq_len=16
)


def llama_step(model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """A training step of `model` on `tokens`: gradients cleared, forward, loss, backward."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()

    return step


def _tiny_llama(device: str = "cpu") -> tuple[Transformer, torch.Tensor]:
    model = Transformer(TINY_LLAMA).to(device)
    return model, torch.randint(0, TINY_LLAMA.vocab_size, (1, 8), device=device)


def tiny_llama_step(device: str = "cpu") -> Callable[[], None]:
    """A training step of a Llama too small for its arithmetic to count, built from the family's
    own blocks (RMSNorm, RoPE, grouped-query attention, SwiGLU): the host's work per op as a
    transformer's step pays it. Its module calls, views and autograd nodes come with each op: ~7 us
    per counted op here, where the plain linear/norm/activation stack (`tiny_step`) reads ~3.7."""
    return llama_step(*_tiny_llama(device))


def op_overhead(device: str = "cpu", probe: Callable[[str], Callable[[], None]] = tiny_llama_step) -> float:
    """Seconds of host work per op of a training step, on ops too small for their arithmetic to
    count: `probe`'s step (a tiny Llama's), over the ops op_costs.CostRecorder counts in it (the
    same count the step-time model multiplies by this). On a GPU the tiny kernels run faster than
    the host launches them: what is timed is the host."""
    seconds, cost = seconds_and_cost(probe(device), device)
    return seconds / cost.ops


def dtensor_op_overhead(per_op: float) -> float:
    """Seconds of host work per op on DTensors beyond its local ops, as a tensor-parallel step pays
    it: blocks planned as parallelisms/tp.py plans a transformer's (a sequence-parallel norm,
    column- then row-wise linears back to sequence shards) on rank 0 of a 2-rank mesh under
    torch's fake process group, so DTensor's sharding propagation and redistribution run in full
    and its collectives do nothing. Less its local ops at `per_op`, over the DTensor ops counted.
    (Replicated DTensors on a 1-rank mesh, a simpler probe, read ~6x less: DTensor
    skips most of its work there; fits to measured runs had found the same factor.)"""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        plan = {}
        for i in range(_TPStack.BLOCKS):
            plan[f"blocks.{i}.norm"] = SequenceParallel(sequence_dim=0)
            plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(0))
            plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(0))
        model = parallelize_module(_TPStack(), mesh, plan)
        # this rank's sequence shard
        seconds, cost = seconds_and_cost(training_step(model, torch.randn(2, _TPStack.DIM)))
    finally:
        dist.destroy_process_group()
    return max(0.0, seconds - cost.ops * per_op) / max(1, cost.dtensor_ops)


def fsdp_unit_overhead() -> float:
    """Seconds of host work per FSDP unit per microbatch (its forward and backward) beyond the ops
    it dispatches: FSDP2's hooks in Python (unsharding, copy-in and -out, resharding, the
    reduce-scatter's bookkeeping). The tiny Llama's step wrapped as a run wraps it (per block, the
    embeddings, norm + output, the root) over 2 ranks under torch's fake process group (its
    collectives do nothing), against the same step unsharded (`hooks_beyond_ops`). ~1.2 ms a unit
    on this project's 2-core VM, ~150 ops' worth. Host work whatever the device: probed on CPU
    tensors."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model, tokens = _tiny_llama()
        apply_fsdp(model, init_device_mesh("cpu", (2,)), FSDPConfig())  # as a run wraps it
        return hooks_beyond_ops(tiny_llama_step(), llama_step(model, tokens), fsdp_units(model))
    finally:
        dist.destroy_process_group()


def checkpoint_overhead() -> float:
    """Seconds of host work per checkpointed block per microbatch (its forward and backward) beyond
    the ops it dispatches, the recompute's included: torch's non-reentrant checkpoint packs and
    unpacks every tensor the block saves through Python hooks, twice (forward, recompute) with a
    metadata check. The tiny Llama's step with every block checkpointed as a run checkpoints them
    (mode full), against the same step without (`hooks_beyond_ops`). ~0.7-0.9 ms a block on this
    project's 2-core VM (~110 ops' worth; ~1/3 of it in the forward), which made full AC's
    measured cost 1.5-5x what the ops alone predicted. A dense Llama block's: a
    block that saves more tensors (an MoE block) pays more."""
    model, tokens = _tiny_llama()
    full = ACPolicy("full")
    apply_ac(model, full)
    return hooks_beyond_ops(tiny_llama_step(), llama_step(model, tokens), checkpointed_blocks(model, full))


def hooks_beyond_ops(plain: Callable[[], None], hooked: Callable[[], None], units: int) -> float:
    """Seconds per unit that `hooked` (the same step with `units` units' hooks) takes beyond its
    ops priced at `plain`'s cost per op. Both timed in each of PROBE_ROUNDS rounds, back to back, and
    the least of each kept apart: a slow plain reading would price the ops high and read the hooks
    low, so the least of the differences would pick the rounds a busy host disturbed."""
    plain_cost, hooked_cost = cost_of(plain), cost_of(hooked)
    readings = [(median_seconds(plain), median_seconds(hooked)) for _ in range(PROBE_ROUNDS)]
    per_op = min(p for p, _ in readings) / plain_cost.ops
    return max(0.0, min(h for _, h in readings) - hooked_cost.ops * per_op) / units


def least_of(probe: Callable[..., float], *args) -> float:
    """A host probe's least reading of PROBE_ROUNDS: a slow second of a shared host only adds (the
    DTensor probe read 105 us in one calibration, 56-61 us in five rounds alone a while later; the
    plain op read 2x its usual in one CI run, level with the Llama's)."""
    return min(probe(*args) for _ in range(PROBE_ROUNDS))


def host_costs(device: str = "cpu") -> tuple[dict[str, float], float]:
    """The host's work per op (`device`'s), per DTensor op, per FSDP unit and per checkpointed
    block, as the Profile fields of those names, each its probe's least reading of PROBE_ROUNDS
    (as calibrate measures them); and, apart, what a plain op costs (the DTensor probe's local ops
    are priced at it)."""
    costs = {"op_overhead_s": least_of(op_overhead, device)}
    # DTensor's dispatch is the host's work whatever the device: probed on CPU tensors, less their
    # local ops (plain linear/norm/activation layers) at what such an op costs a CPU
    plain_op = least_of(op_overhead, "cpu", tiny_step)
    costs["dtensor_op_overhead_s"] = least_of(dtensor_op_overhead, plain_op)
    # FSDP2's and checkpointing's hooks: the host's, too; differences of two steps, each step's
    # least reading kept apart (hooks_beyond_ops)
    costs["fsdp_unit_overhead_s"] = fsdp_unit_overhead()
    costs["checkpoint_overhead_s"] = checkpoint_overhead()
    return costs, plain_op


class _TPStack(torch.nn.Module):
    """Residual blocks of norm, up- and down-projection: tiny, so the host's work is what is timed."""

    BLOCKS, DIM, HIDDEN = 8, 8, 16

    def __init__(self) -> None:
        super().__init__()
        d, h = self.DIM, self.HIDDEN
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {"norm": torch.nn.RMSNorm(d), "up": torch.nn.Linear(d, h), "down": torch.nn.Linear(h, d)}
            )
            for _ in range(self.BLOCKS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["down"](torch.nn.functional.silu(b["up"](b["norm"](x))))
        return x
