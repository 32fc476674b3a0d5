"""A training step's time, predicted from the traced work of each role (op_costs) and a hardware
profile (hardware.py), before anything runs. `meshforge tune` ranks layouts by it.

Per phase of a rank's step (an action of its schedule, the gradient reduction, the collectives the
step waits on before its update (`sync`), the optimizer):
    compute  = (sum over dtypes of matmul FLOPs / matmul rate + attention FLOPs / attention rate
                + bytes the other ops move / memory bandwidth)
                 / the share of those rates a model's step reaches (calibrated)
               + ops x host cost per op
               + DTensor ops x DTensor's host cost per op
               + FSDP units run x half a unit's host cost per microbatch (its hooks)
               + checkpointed blocks run x half a block's host cost per microbatch (its hooks)
    comm     = sum over collectives of latency + bytes x factor / bandwidth (of its group's link)
    time     = blocking comm + max(compute, FSDP comm)       on a GPU (FSDP prefetches its
                                                              all-gathers, reduce-scatters behind)
             = compute + comm                                 on CPU ranks (gloo's copies and
                                                              reductions run on the same cores)
On a GPU the host's part of compute (ops x host cost) runs ahead of the device instead: the step
is the longer of the device's timeline and the busiest rank's host work over the whole step (a
model too small to keep the GPU busy is as fast as its host dispatches).
Pipelines: every pp rank's actions in its schedule's order, each waiting for what it needs (the
previous stage's forward, the next stage's backward); an input from another rank is then received,
a send's time on the receiver's timeline from when both sides are ready (a rendezvous: the send
does not start before its receive is posted; the sender's timeline goes on at once, its send is
asynchronous): the makespan is the critical path, and the bubble is the idle share of it. Ranks
that share CPU cores (the profile's `shared_cores`) run at the share of a core each gets while they
run: a pipeline's idle ranks leave their cores to the others (processor sharing), and more ranks
than cores each run slower still than their share (`sharing_slowdown`: context switches, caches
refilled; calibrated), and an action with collectives waits, after its compute, for its group's
last rank:
    wait     = min(arrival_skew[group] x the rank's computing wall time since its last collective,
                   arrival_skew_cap[group]).
The step ends with every rank's reduction, its sync collectives (the gradient norm's and the
loss's synchronise the ranks), optimizer step and, on one step in `logging.log_every`, the logged
memory figures' gather over the world.

Ignored (said where the tune prints): clipping's multiply, the data loader, the host work between
steps beyond the logged step's gather (writing the logs), and kernel overlap inside a phase.
"""

from __future__ import annotations

import dataclasses

from meshforge.simulate.hardware import Profile


@dataclasses.dataclass(frozen=True)
class PhaseTime:
    compute_s: float  # at the rank's full rate (alone on its device or cores), matmuls included
    matmul_s: float  # the matmuls' part of it (attention's not: it has no weight gradient to split off)
    comm_s: float  # every collective's time
    exposed_comm_s: float  # the part of comm_s not hidden behind compute (on a GPU)
    host_s: float = 0.0  # on a GPU: the host's dispatch, ahead of the device (in compute_s on a CPU)

    def scaled(self, share: float) -> PhaseTime:
        """This phase's time per step when it runs on `share` of the steps."""
        return PhaseTime(*(share * v for v in dataclasses.astuple(self)))


def phase_time(cost: dict, profile: Profile, overlap: bool) -> PhaseTime:
    """One phase's compute and communication (module doc); `overlap`: a GPU's (FSDP's collectives
    beside compute, the host ahead of the device)."""
    # of the probes' rates, in a model's step; the optimizer too (the shrunk llm_1b's fused AdamW:
    # 3.7 ms profiled, 3.0 at the memory probe's rate, 0.81)
    share = profile.model_rate_share
    matmul = sum(f / profile.matmul_rate(d) for d, f in cost["flops"].items()) / share
    attention = sum(f / profile.attention_rate(d) for d, f in cost.get("attention_flops", {}).items()) / share
    host = (
        cost["ops"] * profile.op_overhead_s
        + cost.get("dtensor_ops", 0) * profile.dtensor_op_overhead_s
        # a unit's (a checkpointed block's) forward or backward: half its hooks' cost (measured
        # ~1/3 and ~2/3 for both; a step has both)
        + cost.get("fsdp_units", 0) * profile.fsdp_unit_overhead_s / 2
        + cost.get("checkpointed_blocks", 0) * profile.checkpoint_overhead_s / 2
    )
    memory = cost["memory_bytes"] / profile.memory_Bps / share
    compute = matmul + attention + memory + (0.0 if overlap else host)
    hidden = blocking = 0.0
    for kind, nbytes, ranks, overlapped, count in cost["collectives"]:
        crosses = len({r // profile.ranks_per_node for r in ranks}) > 1
        t = count * profile.collective_time(kind, nbytes, len(ranks), crosses)
        if overlapped and overlap:
            hidden += t
        else:
            blocking += t
    exposed = blocking + max(0.0, hidden - compute)
    return PhaseTime(compute, matmul, blocking + hidden, exposed, host if overlap else 0.0)


@dataclasses.dataclass
class StepPrediction:
    step_s: float
    compute_s: float  # the busiest rank's compute (at full rate)
    comm_s: float  # the busiest rank's communication, hidden or not
    exposed_comm_s: float
    bubble: float  # idle share of the pp ranks' time in the schedule (0 without pipelining)
    # on a GPU: the busiest rank's host dispatch over the step, which runs ahead of the device; the
    # step is host-bound where it is the step (0 on CPU ranks, whose host work is in compute_s)
    host_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Action:
    """A piece of a rank's timeline: `work` seconds of compute at full rate (slowed when cores are
    shared), then `wall` seconds that run regardless (exposed communication)."""

    key: tuple[int, str, int]  # (stage, kind, microbatch)
    work: float
    wall: float
    group: int = 1  # the largest group its collectives run on (1: none): its wait for the last rank


def predict_step(works: dict[int, dict], dims, grad_accum: int, profile: Profile) -> StepPrediction:
    """The step time of a layout from its roles' traced work (`works`: pp rank -> trace `work`;
    one role without pipelining), `grad_accum` microbatches per step without pipelining."""
    overlap = profile.shared_cores == 0
    timelines, totals, hosts = {}, {}, {}
    for pp_rank, work in works.items():
        phases = {p: phase_time(c, profile, overlap) for p, c in work["costs"].items()}
        if "log" in phases:  # a logged step's memory gather, on one step in log_every
            phases["log"] = phases["log"].scaled(1 / work["log_every"])
        tail = [phases[p] for p in TAIL_PHASES if p in phases]
        timelines[pp_rank] = [
            *_actions(work, phases, grad_accum, dims.pp_enabled),
            Action(
                TAIL,
                sum(t.compute_s for t in tail),
                sum(t.exposed_comm_s for t in tail),
                max((largest_group(work["costs"][p]) for p in TAIL_PHASES if p in phases), default=1),
            ),
        ]
        every = _repeated(work, phases, grad_accum, dims.pp_enabled)
        totals[pp_rank] = [
            sum(getattr(t, f) for t in every) for f in ("compute_s", "comm_s", "exposed_comm_s")
        ]
        schedule_host = sum(t.host_s for p, t in phases.items() if p not in TAIL_PHASES)
        repeats = grad_accum - 1 if dims.pp_enabled else 0  # the schedule again per microbatch (below)
        hosts[pp_rank] = sum(t.host_s for t in every) + repeats * schedule_host
    send = 0.0
    if dims.pp_enabled:
        stride = dims.world_size // dims.pp  # pp is the outermost mesh dim
        nbytes = next(iter(works.values()))["boundary_bytes"]
        send = profile.collective_time("send", nbytes, 2, crosses_nodes=stride >= profile.ranks_per_node)
    peers = dims.world_size // len(works)  # ranks that run each timeline at once (dp, cp, tp peers)
    ends, busy = simulate_timed(timelines, send, peers, profile)
    span = max(end for end, _ in ends.values())
    schedule_span = max(end for _, end in ends.values())
    if dims.pp_enabled and grad_accum > 1:  # the trainer runs the whole schedule once per microbatch
        span += (grad_accum - 1) * schedule_span
    bubble = 1 - sum(busy.values()) / (schedule_span * len(ends)) if dims.pp_enabled else 0.0
    compute, comm, exposed = max(totals.values(), key=lambda t: t[0] + t[2])
    # a GPU's host runs ahead of the device: the step waits for the busier (0 on CPU ranks)
    host = max(hosts.values())
    return StepPrediction(max(span, host), compute, comm, exposed, max(0.0, bubble), host)


TAIL = (-1, "tail", 0)  # the reduction, sync collectives, optimizer step and logging after a rank's schedule
TAIL_PHASES = ("reduce", "sync", "optimizer", "log")


def _actions(work: dict, phases: dict[str, PhaseTime], grad_accum: int, pipelined: bool) -> list[Action]:
    """The rank's schedule as timed actions. Without pipelining the trace ran at most two
    microbatches: the second stands for every later one. A zero-bubble schedule's backward is
    traced whole under its input half (I): here I keeps the non-matmul work and half the matmul
    time, W the other half (weight gradients are half of a backward's matmuls)."""
    out, split = [], {}
    for i, (stage, kind, mb) in enumerate(work["actions"]):
        name = f"{i}:{kind}{stage}"
        t = phases.get(name, PhaseTime(0.0, 0.0, 0.0, 0.0))
        group = largest_group(work["costs"].get(name, {}))
        if kind == "I":
            split[(stage, mb)] = t.matmul_s / 2
            out.append(Action((stage, kind, mb), t.compute_s - t.matmul_s / 2, t.exposed_comm_s, group))
        elif kind == "W":
            out.append(Action((stage, kind, mb), split.get((stage, mb), 0.0), 0.0))
        else:
            out.append(Action((stage, kind, mb), t.compute_s, t.exposed_comm_s, group))
    if not pipelined:
        steady = out[-2:]
        later = range(len(out) // 2, grad_accum)
        out += [Action((0, a.key[1], m), a.work, a.wall, a.group) for m in later for a in steady]
    return out


def largest_group(cost: dict) -> int:
    """The most ranks any of a phase's collectives runs on (1 where it has none)."""
    return max((len(ranks) for _, _, ranks, _, _ in cost.get("collectives", ())), default=1)


def _repeated(work: dict, phases: dict[str, PhaseTime], grad_accum: int, pipelined: bool) -> list[PhaseTime]:
    """Every phase of the step as often as it runs (the second microbatch repeated without pp)."""
    listed = list(phases.values())
    if pipelined or grad_accum <= 2:
        return listed
    steady = [phases[f"{i}:{k}{s}"] for i, (s, k, _) in enumerate(work["actions"])][-2:]
    return listed + steady * (grad_accum - 2)


def simulate_timed(
    timelines: dict[int, list[Action]], send_s: float, peers: int, profile: Profile
) -> tuple[dict[int, tuple[float, float]], dict[int, float]]:
    """Play the pp ranks' timelines (module doc): each action starts once what it needs has ended
    (its stage's earlier half, the neighbour stage's action); one whose input comes from another
    rank first receives it, `send_s` of wall time that starts only when both sides are ready
    (gloo's send waits for the receive to be posted: a pipeline's receiver paid 5 ms for 0.5 MB
    sent long before), while a stage's input from its own rank costs nothing. Under
    shared cores the ranks computing at a moment, each with its `peers` (the dp/cp/tp ranks doing
    the same at once), share the cores equally, each slowed by what sharing them costs
    (Profile.core_share). An action with collectives waits, once its work is done, for its group's
    last rank: the profile's arrival_skew of the group times the rank's computing wall time since
    its last collective, at most its arrival_skew_cap. Per rank: (when it finished, when its
    schedule did), and its time busy in the schedule (receiving is not)."""
    last_stage = max(a.key[0] for acts in timelines.values() for a in acts)
    home: dict[int, int] = {}  # a stage -> the rank that runs it
    for r, acts in timelines.items():
        for a in acts:
            if a.key != TAIL and home.setdefault(a.key[0], r) != r:
                raise ValueError(
                    f"stage {a.key[0]} is on ranks {home[a.key[0]]} and {r}: a stage has one rank"
                )
    queues = {r: list(acts) for r, acts in timelines.items()}
    ended: dict[tuple[int, str, int], float] = {}  # an action -> when it ended
    running: dict[int, list] = {}  # rank -> [action, receive left, work left, wall left]
    since_collective = dict.fromkeys(queues, 0.0)  # computing wall since the rank's last collective

    def arrived(r: int, state: list) -> None:  # the action's work done: wait for the group's last rank
        if state[0].group > 1:
            state[3] += profile.arrival_wait(state[0].group, since_collective[r])
            since_collective[r] = 0.0

    ends, busy, now = {}, dict.fromkeys(queues, 0.0), 0.0
    while any(queues.values()) or running:
        for r, q in queues.items():
            if r not in running and q and _ready(q[0].key, ended, last_stage):
                a = q.pop(0)
                source = _source_stage(a.key, last_stage)
                if source is not None and source not in home:
                    raise ValueError(
                        f"stage {a.key[0]} takes its input from stage {source}, which no rank runs"
                    )
                receive = send_s if source is not None and home[source] != r else 0.0
                running[r] = [a, receive, a.work, a.wall]
                if receive <= 0 and a.work <= 0:
                    arrived(r, running[r])
        if not running:
            raise RuntimeError("the pipeline schedule deadlocks: no rank can start its next action")
        computing = [r for r, s in running.items() if s[1] <= 0 and s[2] > 0]
        rate = profile.core_share(len(computing) * peers) if computing else 1.0
        dt = min(s[1] if s[1] > 0 else s[2] / rate if s[2] > 0 else s[3] for s in running.values())
        now += dt
        for r, state in list(running.items()):
            a = state[0]
            if state[1] > 0:  # receiving its input
                state[1] = _spend(state[1], dt)
                if state[1] == 0.0 and state[2] <= 0:
                    arrived(r, state)
                continue
            if a.key != TAIL:
                busy[r] += dt
            if state[2] > 0:
                state[2] = _spend(state[2], dt * rate)
                since_collective[r] += dt
                if state[2] == 0.0:  # snapped to zero, so the group's wait is added once
                    arrived(r, state)
            else:
                state[3] = max(0.0, state[3] - dt)
            if state[2] <= 1e-12 and state[3] <= 1e-12:
                del running[r]
                ended[a.key] = now
                ends[r] = (now, ends.get(r, (0.0, now))[1] if a.key == TAIL else now)
    return ends, busy


def _spend(left: float, spent: float) -> float:
    """What is left of a receive or of work after `spent`: a float remainder below 1e-12 is none,
    so the action that ends this instant is seen to end (and its group's wait is added once)."""
    return left - spent if left - spent > 1e-12 else 0.0


def _source_stage(key: tuple[int, str, int], last_stage: int) -> int | None:
    """The stage whose output an action takes: a forward the previous stage's, a backward (or its
    input half) the next stage's gradient; None for the first forward, the last backward, W."""
    stage, kind, _ = key
    if kind == "F":
        return stage - 1 if stage > 0 else None
    if kind in "BI":
        return stage + 1 if stage < last_stage else None
    return None


def _ready(key: tuple[int, str, int], ended: dict, last_stage: int) -> bool:
    """Whether an action may start: its own stage's earlier half done, and the neighbour stage's
    action it takes its input from ended."""
    stage, kind, mb = key
    if kind == "tail":
        return True
    if kind == "F":
        return stage == 0 or (stage - 1, "F", mb) in ended
    if kind in "BI":
        downstream = stage == last_stage or (stage + 1, "B", mb) in ended or (stage + 1, "I", mb) in ended
        return (stage, "F", mb) in ended and downstream
    return (stage, "I", mb) in ended  # W after its input half
