"""What a pipeline schedule runs: each rank's actions (F forward, B backward, I input-grad,
W weight-grad, idle) per time step, and the bubble fraction the schedule itself implies.

The per-rank action order comes from torch's own schedule object, so it is the schedule
that runs; the timing is simulated: every action takes one time step (F and B alike) and
starts once what it needs is done (the previous stage's F, the next stage's B). The
bubble of a real step also depends on how long each action takes, which the measured step
time shows. run/observe/figures.py draws it.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, ScheduleGPipe

COMPUTE_KINDS = ("F", "B", "I", "W")


def pipeline_order(schedule) -> dict[int, list[str | None]]:
    """rank -> the schedule's compute actions, as simulated time steps ('3F1' = stage 3,
    forward, microbatch 1; None = idle)."""
    if isinstance(schedule, PipelineScheduleSingle):
        # single-stage schedules run their loop directly; their IR (_get_pipeline_order) is
        # not what runs on torch 2.13 (its 1F1B drops the last stage's first forward)
        gpipe = isinstance(schedule, ScheduleGPipe)
        order = {
            r: single_stage_actions(r, schedule._num_stages, schedule._n_microbatches, gpipe)
            for r in range(schedule._num_stages)
        }
    else:
        order = {
            r: [str(x) for a in actions if a is not None for x in _leaves(a)]
            for r, actions in schedule.pipeline_order.items()
        }
    return simulate(order)


def _leaves(action) -> list:
    """DualPipeV's overlapped F+B pairs as their two actions (drawn one after the other)."""
    return list(action.sub_actions) if getattr(action, "sub_actions", None) else [action]


def single_stage_actions(rank: int, stages: int, microbatches: int, gpipe: bool) -> list[str]:
    """What ScheduleGPipe / Schedule1F1B execute on `rank` (as in their _step_microbatches)."""
    if gpipe:
        return [f"{rank}F{m}" for m in range(microbatches)] + [f"{rank}B{m}" for m in range(microbatches)]
    warmup = min(microbatches, stages - rank)  # last stage 1 forward, first stage `stages`
    actions = [f"{rank}F{m}" for m in range(warmup)]
    for b in range(microbatches):  # then 1B1F: backward one, forward the next, then cool down
        actions.append(f"{rank}B{b}")
        if warmup + b < microbatches:
            actions.append(f"{rank}F{warmup + b}")
    return actions


def parse_action(action: str | None) -> tuple[int, str, int] | None:
    """'3F1' -> (3, 'F', 1); None for idle and for non-compute actions (REDUCE_GRAD, ...)."""
    if action is None:
        return None
    stage = action[: len(action) - len(action.lstrip("0123456789"))]
    rest = action[len(stage) :]
    if not stage or rest[:1] not in COMPUTE_KINDS or not rest[1:].isdigit():
        return None
    return int(stage), rest[0], int(rest[1:])


def action_kind(action: str | None) -> str | None:
    """'3F1' -> 'F'; None for idle and non-compute actions."""
    parsed = parse_action(action)
    return parsed[1] if parsed else None


def simulate(order: dict[int, list[str]]) -> dict[int, list[str | None]]:
    """Place each rank's compute actions on unit time steps, each waiting for its inputs."""
    queues = {r: [a for a in actions if parse_action(a)] for r, actions in order.items()}
    last_stage = max(parse_action(a)[0] for q in queues.values() for a in q)
    done: set[tuple[str, int, int]] = set()

    def ready(action: str) -> bool:
        stage, kind, mb = parse_action(action)
        if kind == "F":
            return stage == 0 or ("F", stage - 1, mb) in done
        if kind in "BI":
            grad_in = stage == last_stage or ("B", stage + 1, mb) in done or ("I", stage + 1, mb) in done
            return ("F", stage, mb) in done and grad_in
        return ("I", stage, mb) in done  # W: after its input-gradient half

    timeline: dict[int, list[str | None]] = {r: [] for r in order}
    while any(queues.values()):
        started = [q.pop(0) if q and ready(q[0]) else None for q in queues.values()]
        if not any(started):
            raise RuntimeError("the pipeline schedule deadlocks: no rank can start its next action")
        for rank, action in zip(queues, started):
            timeline[rank].append(action)
        done.update((k, s, m) for s, k, m in map(parse_action, filter(None, started)))
    return timeline


def bubble_fraction(order: dict[int, list[str | None]]) -> float:
    """Idle share of all ranks' time steps, from the first to the last compute action."""
    span = max(i + 1 for actions in order.values() for i, a in enumerate(actions) if action_kind(a))
    busy = sum(1 for actions in order.values() for a in actions[:span] if action_kind(a))
    return 1 - busy / (span * len(order))
