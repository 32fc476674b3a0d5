"""What one rank's traced step asks of its device, phase by phase: matmul FLOPs by dtype (and
attention's apart), bytes moved by the other (memory-bound) ops, how many ops it dispatches, and
every collective (kind, bytes, the ranks of its group). Device-independent: step_time.py prices it
with a hardware profile. Recorded by `CostRecorder` beside the memory tracker in the same traced
step (trace.py), so the memory estimate and the time estimate read one trace; only the optimizer
is counted on a step of its own, the run's optimizer, stepped after the one traced for memory.

Counted on the rank's local tensors: an op on DTensors is passed on (NotImplemented) to
DTensor, whose local ops come back through the recorder, so a TP rank's matmul counts its
shard of the FLOPs and DTensor's own redistributions count as the collectives they are. The
DTensor ops are counted too: each costs the host DTensor's dispatch (sharding propagation,
wrapping), which a CPU rank pays on top of its local ops.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten, c10d, functional = torch.ops.aten, torch.ops.c10d, torch.ops._c10d_functional


def _per_query_head(q: torch.Tensor, kv: torch.Tensor) -> tuple[int, ...]:
    """A key or value's shape with the query's heads: grouped-query attention computes each query
    head against its group's key (torch before 2.13 asserts equal heads in its formulas)."""
    return (kv.shape[0], q.shape[1], *kv.shape[2:])


def _sdpa_forward_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_, **__) -> float:
    return sdpa_flop_count(q.shape, _per_query_head(q, k), _per_query_head(q, v))


def _sdpa_backward_flops(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_, **__
) -> float:
    return sdpa_backward_flop_count(g.shape, q.shape, _per_query_head(q, k), _per_query_head(q, v))


def sdpa_step_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """SDPA's forward and backward FLOPs on these tensors, as the trace counts them whatever the
    backend (torch's formulas, GQA's key and value heads expanded, a causal mask not discounted)."""
    return _sdpa_forward_flops(q, k, v) + _sdpa_backward_flops(q, q, k, v)  # the gradient: q's shape


# torch's CPU flash attention is missing from its FLOP registry: the same formula as its CUDA twins
_CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
}

# attention's kernels (forward and backward, every backend; the CPU's too): priced at the
# profile's attention rate, which flash attention reaches less of than a plain matmul does
ATTENTION = {op for op in flop_registry if "attention" in str(op)} | set(_CPU_ATTENTION)

# collective op -> (kind, index of the tensor whose size is the collective's: the gathered
# output, the unreduced input). wait ops and views of buffers cost nothing here.
COLLECTIVES = {
    c10d._allgather_base_: ("all_gather", 0),
    c10d._reduce_scatter_base_: ("reduce_scatter", 1),
    c10d.allreduce_: ("all_reduce", 0),
    c10d.alltoall_base_: ("all_to_all", 1),
    c10d.broadcast_: ("broadcast", 0),
    functional.all_gather_into_tensor: ("all_gather", -1),  # -1: the output
    functional.all_gather_into_tensor_out: ("all_gather", -1),
    functional.reduce_scatter_tensor: ("reduce_scatter", 0),
    functional.all_reduce: ("all_reduce", 0),
    functional.all_to_all_single: ("all_to_all", 0),
    functional.broadcast: ("broadcast", 0),
}
# FSDP's own collectives run beside compute (prefetched all-gathers, reduce-scatters behind the
# backward); DTensor's (TP, CP, EP: functional collectives) sit on the critical path
OVERLAPPED = {c10d._allgather_base_, c10d._reduce_scatter_base_, c10d.allreduce_}
# phases whose collectives the step waits on whatever op they use: the token count, gradient norm
# and loss between backward and optimizer (trace.py's "sync"), a logged step's memory figures ("log")
BLOCKING_PHASES = {"sync", "log"}

FUSED_ADAM = {aten._fused_adam_, aten._fused_adamw_}

# `tensor.device` reaches a dispatch mode as prim.device on a fake tensor (autograd and checkpointing
# ask it: most of a traced step's local dispatches) but is an attribute read on a real one: counted
# as an op moving its tensor, it made a trace's op count ~3.6x and its bytes ~2.5x the real step's.
# The recorder passes it on first, uncounted.
DEVICE = torch.ops.prim.device.default
# ops that move no data: metadata, views, fresh (uninitialised) buffers, waiting for a collective
FREE = {
    aten.empty,
    aten.empty_strided,
    aten.empty_like,
    aten.detach,
    aten.lift_fresh,
    aten.alias,
    functional.wait_tensor,
}


@dataclasses.dataclass
class PhaseCost:
    """One phase of a rank's step (an action of its schedule, the reduction, the optimizer)."""

    flops: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))  # by dtype
    attention_flops: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    memory_bytes: float = 0.0  # read + written by the ops that are not matmuls
    ops: int = 0  # local ops dispatched (each has a fixed host cost on top of its work)
    dtensor_ops: int = 0  # ops on DTensors: DTensor's sharding and redistribution logic, per op, on the host
    # FSDP units' forwards (in a forward phase) or backwards (in a backward): their hooks' host work
    fsdp_units: int = 0
    # checkpointed blocks run (forward, or backward with its recompute): their hooks' host work
    checkpointed_blocks: int = 0
    # (kind, bytes, group ranks, overlapped) -> count
    collectives: Counter = dataclasses.field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {
            "flops": dict(self.flops),
            "attention_flops": dict(self.attention_flops),
            "memory_bytes": self.memory_bytes,
            "ops": self.ops,
            "dtensor_ops": self.dtensor_ops,
            "fsdp_units": self.fsdp_units,
            "checkpointed_blocks": self.checkpointed_blocks,
            "collectives": [[*key, n] for key, n in self.collectives.items()],
        }


class CostRecorder(TorchDispatchMode):
    """Counts each op of a traced step into the phase `phase()` names (see module doc)."""

    def __init__(self, phase: Callable[[], str | None]):
        super().__init__()
        self.phase = phase
        self.phases: dict[str, PhaseCost] = defaultdict(PhaseCost)
        self.paused = False  # ops run uncounted (a step traced for its memory, priced by another)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE:  # the commonest dispatch of a trace, and free: no search of its arguments
            return func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        if self.paused:
            return NotImplemented if any(isinstance(t, DTensor) for t in leaves) else func(*args, **kwargs)
        phase = self.phase() or "setup"
        cost = self.phases[phase]
        if any(isinstance(t, DTensor) for t in leaves):
            cost.dtensor_ops += 1
            return NotImplemented  # DTensor runs it; its local ops come back here
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in COLLECTIVES:
            kind, index = COLLECTIVES[packet]
            sized = out if index == -1 else args[index]
            sized = sized[0] if isinstance(sized, list | tuple) else sized
            group = _group_ranks(_group_arg(func, args, kwargs))
            overlapped = packet in OVERLAPPED and phase not in BLOCKING_PHASES
            cost.collectives[(kind, tensor_bytes(sized), group, overlapped)] += 1
        elif func.is_view or packet in FREE or not any(isinstance(t, torch.Tensor) for t in leaves):
            pass
        elif packet in flop_registry or packet in _CPU_ATTENTION:
            formula = _CPU_ATTENTION.get(packet) or flop_registry[packet]
            counted = cost.attention_flops if packet in ATTENTION else cost.flops
            counted[str(args[0].dtype).removeprefix("torch.")] += formula(*args, **kwargs, out_val=out)
            cost.ops += 1
        else:
            moved = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            cost.memory_bytes += sum(
                tensor_bytes(t) for t in moved + _written_in_place(func, args, kwargs, out)
            )
            cost.ops += 1
        return out

    def result(self) -> dict[str, dict]:
        return {phase: cost.as_dict() for phase, cost in self.phases.items()}


def _written_in_place(func, args, kwargs, out) -> list[torch.Tensor]:
    """The tensors an op that returns nothing writes (its schema's `Tensor(a!)` arguments): a
    foreach or fused op updates its lists in place, and each element is read and written. Fused
    Adam(W)'s schema marks the gradients written, which its kernel does only to unscale them
    (`grad_scale` given): otherwise they are read."""
    if not (out is None or (isinstance(out, list | tuple) and not out)):
        return []  # an op with outputs (an in-place one returns its input): they count the write
    schema = func._schema.arguments
    values = {a.name: (args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema)}
    written = [a.name for a in schema if a.alias_info and a.alias_info.is_write]
    if func._overloadpacket in FUSED_ADAM and values.get("grad_scale") is None:
        written.remove("grads")
    return [t for t in tree_leaves([values[name] for name in written]) if isinstance(t, torch.Tensor)]


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor's elements take (its local shard's, for a DTensor's local tensor)."""
    return t.numel() * t.element_size()


def _group_arg(func, args, kwargs):
    """A collective's group argument (c10d: `process_group`; functional: `group_name`)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("process_group", "group_name"):
            return kwargs[a.name] if a.name in kwargs else args[i]
    raise RuntimeError(f"{func}: no group argument in its schema")


def _group_ranks(group) -> tuple[int, ...]:
    """The global ranks of a collective's group: a functional collective names it, a c10d op
    passes the process group itself."""
    if isinstance(group, torch.ScriptObject):
        group = ProcessGroup.unbox(group)
    name = group if isinstance(group, str) else group.group_name
    return tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name)))
