"""One checkpoint format for both frameworks: a `backend = "jax"` run resumes a torch run's
checkpoint (parameters, AdamW's moments and step, the LR schedule's position, the data position)
and saves its own as the torch trainer does, so either framework continues the other on any mesh
(tests/interop/test_jax_resume.py measures steps 6-10 against the same run's own).

A checkpoint is read as one process reads any DCP checkpoint (full tensors, whatever mesh saved
it) and placed with the JAX run's NamedShardings; it is written from a one-process torch mirror
of the JAX state (the model and AdamW the torch trainer would hold), so its keys, optimizer
groups and meta.json are the torch trainer's own. torch's AdamW and optax's adamw are the same
update (decoupled decay, bias corrections from the step count, eps outside the square root): its
`exp_avg`/`exp_avg_sq` are optax's `mu`/`nu` and its `step` is optax's `count`. What the JAX run
cannot take is refused naming what differs, never replaced by a fresh optimizer; changed AdamW
settings (lr, betas, eps, weight decay) are the recipe's from the resumed step on, and said, as in
a torch resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from meshforge.configs import Recipe
from meshforge.core.errors import CheckpointError
from meshforge.jax.bridge import state_to_pytree
from meshforge.models import get_model_spec
from meshforge.run.checkpoint.dcp import dcp_load, model_args_of, read_meta
from meshforge.run.checkpoint.state import optimizer_changes
from meshforge.run.train.optim import build_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class TorchTrainingState:
    """What a torch checkpoint holds for a JAX run: flat pytrees keyed by parameter FQN."""

    params: dict[str, jax.Array]
    mu: dict[str, jax.Array]
    nu: dict[str, jax.Array]
    adam_step: int  # AdamW's step counter (every parameter's: one count in optax)
    meta: dict
    optimizer_changes: list[str] = dataclasses.field(default_factory=list)  # the recipe's settings now


def model_refusal(meta: dict, model_args) -> str | None:
    """Why the checkpoint's weights do not fit a model of `model_args` (None: they do)."""
    saved = model_args_of(meta)
    fields = [f.name for f in dataclasses.fields(model_args)]
    if changed := [k for k in fields if getattr(saved, k, None) != getattr(model_args, k)]:
        was = ", ".join(f"{k}: {getattr(saved, k, None)!r} -> {getattr(model_args, k)!r}" for k in changed)
        return f"the checkpoint is another model ({was}): resume it with the [model] it was saved with"
    return None


def state_refusals(meta: dict, recipe: Recipe) -> list[str]:
    """Why a JAX run of `recipe` cannot continue the checkpoint's training state (none: it can).
    Another optimizer is refused by optimizer_changes; changed AdamW settings are the recipe's
    from here on, as in a torch resume."""
    problems = []
    if meta.get("loss_scale"):
        problems.append(
            "the checkpoint is an fp16 run's (it holds a loss scale): backend=jax trains without "
            "loss scaling; start from its weights (checkpoint.init_from=<its folder>)"
        )
    if (at := meta.get("lr_scheduler", {}).get("last_epoch", meta["step"])) != meta["step"]:
        problems.append(f"the checkpoint's LR schedule is at step {at} and its run at {meta['step']}")
    return problems


def read_torch_checkpoint(
    path: Path, recipe: Recipe, model_args, shapes: dict[str, tuple[int, ...]], weights_only: bool = False
) -> TorchTrainingState:
    """The parameters (and, unless `weights_only`, AdamW's moments and step) of the torch
    checkpoint at `path` for the parameters named in `shapes`; a CheckpointError naming what a
    JAX run of `recipe` cannot take."""
    meta = read_meta(path)
    problems = [p for p in [model_refusal(meta, model_args)] if p]
    problems += [] if weights_only else state_refusals(meta, recipe)
    changes = [] if weights_only else optimizer_changes(meta["recipe"].get("optimizer", {}), recipe.optimizer)
    if problems:
        raise CheckpointError(
            f"cannot {'start from' if weights_only else 'resume'} {path} under backend=jax: "
            + "; ".join(problems)
        )
    model = {k: torch.empty(s) for k, s in shapes.items()}
    state: dict = {"model": model}
    if not weights_only:
        state["optim"] = {f"state.{k}.{m}": torch.empty(s) for k, s in shapes.items() for m in MOMENTS}
        state["optim"] |= {f"state.{k}.step": torch.zeros(()) for k in shapes}
    dcp_load(state, path)
    params = state_to_pytree(model)
    if weights_only:
        return TorchTrainingState(params, {}, {}, 0, meta)
    optim = state["optim"]
    steps = {int(optim[f"state.{k}.step"]) for k in shapes}
    if len(steps) != 1:
        raise CheckpointError(
            f"cannot resume {path} under backend=jax: its parameters were stepped {sorted(steps)} times "
            "(optax keeps one count for all)"
        )
    mu, nu = ({k: optim[f"state.{k}.{m}"] for k in shapes} for m in MOMENTS)
    return TorchTrainingState(params, state_to_pytree(mu), state_to_pytree(nu), steps.pop(), meta, changes)


def with_adam_moments(opt_state, mu: dict, nu: dict, count: int, shardings: dict):
    """optax's inject_hyperparams(adamw) state with torch's moments and step in place, each moment
    placed as its parameter is."""

    def placed(tree: dict) -> dict:
        return {name: jax.device_put(v, shardings[name]) for name, v in tree.items()}

    adam, *rest = opt_state.inner_state

    def steps() -> jax.Array:  # one array each: the step donates its inputs' buffers
        return jnp.asarray(count, dtype=jnp.int32)

    adam = adam._replace(count=steps(), mu=placed(mu), nu=placed(nu))
    return opt_state._replace(count=steps(), inner_state=(adam, *rest))


def torch_mirror(recipe: Recipe, model_args, params: dict, mu: dict, nu: dict, count: int, lr: float):
    """The JAX state as a one-process torch run holds it after `count` optimizer steps: the
    model, and AdamW (the recipe's implementation) with the moments, the step and the next
    step's `lr` (as torch's LR scheduler leaves it)."""
    model = get_model_spec(recipe.model.name).build(model_args)
    model.init_buffers()
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            if name in params:  # a tied output weight is the embedding's
                p.copy_(torch.from_numpy(np.array(params[name])))
    opt = build_optimizer(model.named_parameters(), recipe.optimizer)
    for group in opt.param_groups:
        group.update(lr=lr, initial_lr=recipe.optimizer.lr)  # what LambdaLR keeps in each group
    for name, p in named.items():
        if name in mu:
            opt.state[p] = {
                "step": torch.tensor(float(count)),
                "exp_avg": torch.from_numpy(np.array(mu[name])),
                "exp_avg_sq": torch.from_numpy(np.array(nu[name])),
            }
    return model, opt


def scheduler_state(recipe: Recipe, step: int, lr: float) -> dict:
    """torch's LambdaLR state after `step` steps, as the torch trainer's meta.json holds it."""
    return {
        "base_lrs": [recipe.optimizer.lr],
        "last_epoch": step,
        "_step_count": step + 1,
        "_is_initial": False,
        "_get_lr_called_within_step": False,
        "_last_lr": [lr],
        "lr_lambdas": [None],
    }


class Deferred(Stateful):
    """A checkpoint entry whose torch state is made when a save asks for it (`make`); a JAX run
    loads through read_torch_checkpoint, never through this."""

    def __init__(self, make: Callable[[], Stateful]):
        self.make = make

    def state_dict(self) -> dict:
        return self.make().state_dict()

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("a JAX run reads checkpoints with read_torch_checkpoint")
