"""`--space KEY=SPEC`: a recipe field and the Optuna distribution it is searched over.

SPEC is `log(LOW,HIGH)` or `float(LOW,HIGH[,STEP])` (a float), `int(LOW,HIGH[,STEP])`, or
`choice(A,B,...)` (values as an override writes them: layouts, schedule names, numbers). Every
key is checked against the recipe's schema (did-you-mean) with the values it can take, before
any trial runs."""

from __future__ import annotations

import re

import optuna.distributions as od

from meshforge.configs import load_config
from meshforge.core.errors import RecipeError, UsageError

SPEC_FORMS = "log(1e-4,1e-2), float(0.0,0.1), int(0,200) or choice(a,b,...)"
_SPEC = re.compile(r"^(log|float|int|choice)\((.*)\)$")


# set by the search itself for every run (its seeds, folder and W&B grouping): a sampled value
# would be recorded in the study and never used
SET_BY_SEARCH = (
    "seed",
    "data.seed",
    "output_dir",
    "run_name",
    "logging.wandb_group",
    "logging.wandb_tags",
    "logging.wandb_job_type",
)


def parse_space(items: list[str], recipe_path: str, overrides: list[str]) -> dict[str, od.BaseDistribution]:
    """Every `KEY=SPEC` as {key: distribution}; a malformed one, or a key the recipe does not have,
    raises a UsageError naming it and the fix."""
    if not items:
        raise UsageError(
            "search: no --space given; add one or more, e.g. --space optimizer.lr=log(1e-4,1e-2)"
        )
    space = {}
    for item in items:
        key, sep, spec = item.partition("=")
        if not sep or not key or not spec:
            raise UsageError(f"--space {item!r}: expected KEY=SPEC, e.g. optimizer.lr=log(1e-4,1e-2)")
        if key in space:
            raise UsageError(f"--space {key}: given twice; keep one")
        if key in SET_BY_SEARCH:
            raise UsageError(
                f"--space {key}: the search sets {key} for every run itself (seeds: --seeds K; the "
                "folder: --search-dir; W&B: the study's group), so a sampled value would never be used; "
                "remove it"
            )
        space[key] = parse_spec(key, spec.strip())
        check_field(key, space[key], recipe_path, overrides)
    return space


def parse_spec(key: str, spec: str) -> od.BaseDistribution:
    """One SPEC as an Optuna distribution."""
    m = _SPEC.match(spec)
    if not m:
        raise UsageError(f"--space {key}={spec}: unknown SPEC; write {SPEC_FORMS}")
    kind, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    if kind == "choice":
        if not all(args) or len(set(args)) != len(args):
            raise UsageError(
                f"--space {key}={spec}: choice needs distinct, non-empty values, e.g. choice(a,b)"
            )
        return od.CategoricalDistribution(args)
    if len(args) not in (2, 3) or (kind == "log" and len(args) != 2):
        usage = "log(LOW,HIGH)" if kind == "log" else f"{kind}(LOW,HIGH[,STEP])"
        raise UsageError(f"--space {key}={spec}: expected {usage}")
    number = int if kind == "int" else float
    try:
        low, high, *step = (number(a) for a in args)
    except ValueError:
        raise UsageError(
            f"--space {key}={spec}: bounds must be {number.__name__}s, e.g. {kind}(1,10)"
        ) from None
    if not low < high:
        raise UsageError(f"--space {key}={spec}: LOW ({args[0]}) must be below HIGH ({args[1]})")
    if kind == "log" and low <= 0:
        raise UsageError(f"--space {key}={spec}: log needs LOW > 0; use float(...) for a range from 0")
    if step and step[0] <= 0:
        raise UsageError(f"--space {key}={spec}: STEP must be positive")
    if kind == "int":
        return od.IntDistribution(low, high, step=step[0] if step else 1)
    return od.FloatDistribution(low, high, log=kind == "log", step=step[0] if step else None)


def as_override(key: str, value) -> str:
    """A sampled value as the `key=value` override its run gets (floats in full precision)."""
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"


def check_field(key: str, dist: od.BaseDistribution, recipe_path: str, overrides: list[str]) -> None:
    """The recipe takes `key` with the values `dist` reaches (its ends, or every choice): the same
    key and type checks as any override, said on one line."""
    if isinstance(dist, od.CategoricalDistribution):
        values = list(dist.choices)
    else:
        values = [dist.low, dist.high]
    for value in values:
        try:
            load_config(recipe_path, [*overrides, as_override(key, value)])
        except RecipeError as e:
            said = "; ".join(f"{p.field} = {p.value!r}: {p.message}" for p in e.problems)
            raise UsageError(f"--space {key}: {said}") from None
