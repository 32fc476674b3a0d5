"""[optimizer]'s own rules: a known optimizer.name (did-you-mean), the chosen optimizer's ranges,
and the kinds of parameter the group rules name (settings of another optimizer are inert.py's);
the warmup-stable-decay settings of [lr_scheduler]."""

from __future__ import annotations

import difflib

from meshforge.configs import Recipe
from meshforge.configs.training import OPTIMIZER_READS, PARAM_KINDS
from meshforge.core.errors import Problem


def check_optimizer(r: Recipe) -> list[Problem]:
    """optimizer.name (did-you-mean), each optimizer's own ranges, and the parameter-group rules."""
    o = r.optimizer
    if o.name not in OPTIMIZER_READS:
        close = difflib.get_close_matches(o.name, OPTIMIZER_READS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        return [Problem("optimizer.name", o.name, f"{hint}must be one of {', '.join(OPTIMIZER_READS)}")]
    problems = jax_problems(r)
    kinds = f"kinds are {', '.join(PARAM_KINDS)}"
    problems += [
        Problem("optimizer.no_decay", k, f"not a kind of parameter; {kinds}")
        for k in o.no_decay
        if k not in PARAM_KINDS
    ]
    for kind, mult in o.lr_multipliers.items():
        if kind not in PARAM_KINDS:
            problems.append(
                Problem(f"optimizer.lr_multipliers.{kind}", mult, f"not a kind of parameter; {kinds}")
            )
        elif not mult > 0:
            problems.append(Problem(f"optimizer.lr_multipliers.{kind}", mult, "must be > 0, e.g. 0.5"))
    s, lion, m = o.sgd, o.lion, o.muon
    checks = {
        "sgd": [
            ("optimizer.sgd.momentum", s.momentum, s.momentum >= 0, "must be >= 0, e.g. 0.9"),
            ("optimizer.sgd.dampening", s.dampening, 0 <= s.dampening < 1, "must be in [0, 1)"),
            (
                "optimizer.sgd.nesterov",
                s.nesterov,
                not s.nesterov or (s.momentum > 0 and s.dampening == 0),
                "Nesterov needs optimizer.sgd.momentum > 0 and optimizer.sgd.dampening = 0",
            ),
        ],
        "lion": [
            (
                "optimizer.lion.betas",
                lion.betas,
                len(lion.betas) == 2 and all(0 <= b < 1 for b in lion.betas),
                "must be two numbers in [0, 1), e.g. [0.9, 0.99]",
            )
        ],
        "muon": [
            ("optimizer.muon.momentum", m.momentum, 0 <= m.momentum < 1, "must be in [0, 1), e.g. 0.95"),
            ("optimizer.muon.ns_steps", m.ns_steps, 0 < m.ns_steps < 100, "must be in 1..99, e.g. 5"),
            ("optimizer.muon.eps", m.eps, m.eps > 0, "must be > 0, e.g. 1e-7"),
            ("optimizer.muon.adamw_lr", m.adamw_lr, m.adamw_lr >= 0, "must be >= 0 (0 = optimizer.lr)"),
            (
                "optimizer.muon.ns_coefficients",
                m.ns_coefficients,
                len(m.ns_coefficients) == 3,
                "must be three numbers a, b, c, e.g. [3.4445, -4.775, 2.0315]",
            ),
        ],
    }.get(o.name, [])
    return problems + [Problem(name, value, fix) for name, value, ok, fix in checks if not ok]


def jax_problems(r: Recipe) -> list[Problem]:
    """backend=jax steps optax's adamw over one parameter group."""
    if r.backend != "jax":
        return []
    problems = []
    o = r.optimizer
    if o.name != "adamw":
        problems.append(
            Problem(
                "optimizer.name",
                o.name,
                "backend=jax trains with optax's adamw: set optimizer.name=adamw or backend=torch",
            )
        )
    for name, value in (("no_decay", o.no_decay), ("lr_multipliers", o.lr_multipliers)):
        if value:
            problems.append(
                Problem(
                    f"optimizer.{name}",
                    value,
                    f"backend=jax has one parameter group: set optimizer.{name}=[] or backend=torch",
                )
            )
    return problems


def check_schedule(r: Recipe) -> list[Problem]:
    """decay_ratio in [0, 1]; the sqrt decay and decay_ratio are TorchTitan's, not DeepSpeed's."""
    s = r.lr_scheduler
    problems = []
    if s.decay_ratio is not None and not 0 <= s.decay_ratio <= 1:
        problems.append(Problem("lr_scheduler.decay_ratio", s.decay_ratio, "must be in [0, 1], or null"))
    if s.convention == "deepspeed":
        fix = "DeepSpeed's schedules have no such setting: set lr_scheduler.convention=torchtitan, or"
        if s.decay_ratio is not None:
            problems.append(Problem("lr_scheduler.decay_ratio", s.decay_ratio, f"{fix} decay_ratio=null"))
        if s.decay == "sqrt":
            problems.append(Problem("lr_scheduler.decay", s.decay, f"{fix} decay=linear or cosine"))
    return problems
