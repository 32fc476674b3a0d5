"""What a checkpoint holds of a rank: its model parts and their optimizers, as FQN-keyed state
dicts (DCP reshards them on load, so any mesh loads any checkpoint). A tied weight is stored
once, under the embedding's name, whichever parts hold it."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from meshforge.configs.schema import OptimizerConfig
from meshforge.core.errors import CheckpointError

log = logging.getLogger(__name__)

# optimizer state keyed by parameter FQN (not by index), so it reshards like the model
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def tied_alias(part: nn.Module) -> Callable[[str], str]:
    """A checkpoint key's stored name: a tied output weight (and its optimizer state) is the
    embedding's, stored once under the embedding's name, whether this part holds the embedding
    too (one tensor) or is a pipeline's last stage holding a copy (parallelisms/tied.py)."""
    if not (getattr(part, "args", None) and part.args.tie_embeddings and part.output is not None):
        return lambda key: key
    return lambda key: re.sub(
        r"^((?:state|param_groups)\.)?output\.weight(?=\.|$)", r"\1tok_embeddings.weight", key
    )


def _merged(parts: list[nn.Module], state_dicts: list[dict]) -> dict[str, Any]:
    """Every part's state under its stored names; the first holder of a name keeps it."""
    out: dict[str, Any] = {}
    for part, state in zip(parts, state_dicts):
        stored = tied_alias(part)
        for k, v in state.items():
            out.setdefault(stored(k), v)
    return out


class ModelState(Stateful):
    """This rank's model parts (pipeline stages) as one FQN -> tensor mapping."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return _merged(self.parts, [get_model_state_dict(part) for part in self.parts])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            stored = tied_alias(part)
            own = get_model_state_dict(part)
            set_model_state_dict(part, {k: state[stored(k)] for k in own})


class OptimizerState(Stateful):
    """One optimizer per model part, flattened to FQN keys and merged."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts, self.optimizers = parts, optimizers

    def _own(self) -> list[dict]:
        return [
            get_optimizer_state_dict(part, opt, options=OPTIM_OPTIONS)
            for part, opt in zip(self.parts, self.optimizers)
        ]

    def state_dict(self) -> dict[str, Any]:
        return _merged(self.parts, self._own())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, opt, own in zip(self.parts, self.optimizers, self._own()):
            stored = tied_alias(part)
            set_optimizer_state_dict(part, opt, {k: state[stored(k)] for k in own}, options=OPTIM_OPTIONS)


# [optimizer] fields a resumed run takes from the recipe unsaid: how the step runs, not what it computes
UNREPORTED = ("name", "implementation")


def optimizer_changes(saved: dict, cfg: OptimizerConfig) -> list[str]:
    """The recipe's optimizer settings that differ from the checkpoint's recipe (`saved`, its
    [optimizer]), as 'optimizer.lr: 0.001 -> 0.01'; a CheckpointError for another optimizer, whose
    state this one cannot take."""
    if saved.get("name", cfg.name) != cfg.name:
        raise CheckpointError(
            f"the checkpoint's optimizer is {saved['name']!r} and the recipe's {cfg.name!r}: its state "
            f"cannot continue in another optimizer; set optimizer.name={saved['name']!r}, or start from "
            "its weights (checkpoint.init_from=<its folder>)"
        )

    def plain(v):  # betas: a list in the recipe, a list in meta.json's
        return list(v) if isinstance(v, (list, tuple)) else v

    now = flat_fields(dataclasses.asdict(cfg))
    return [
        f"optimizer.{k}: {v!r} -> {plain(now[k])!r}"
        for k, v in flat_fields(saved).items()
        if k in now and k not in UNREPORTED and plain(v) != plain(now[k])
    ]


def flat_fields(section: dict, prefix: str = "") -> dict:
    """{"muon.momentum": 0.95, ...}: a section's fields, its sub-sections' by dotted name."""
    out = {}
    for k, v in section.items():
        if isinstance(v, dict) and k != "lr_multipliers":  # a sub-section, not a field holding a table
            out.update(flat_fields(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def built_settings(schedulers: list) -> list[list[dict]]:
    """Each optimizer's param groups' settings as this run built them (before a checkpoint loads):
    the recipe's, per group (a group's own lr and weight decay, Muon's AdamW half), and the
    implementation chosen for this mesh's parameters (fused and foreach cannot mix DTensors and
    plain tensors). Loading restores the saving run's; apply_optimizer_settings puts these back."""
    return [
        [{k: v for k, v in g.items() if k != "params"} for g in s.optimizer.param_groups] for s in schedulers
    ]


def say_optimizer_changes(changes: list[str]) -> None:
    """The warning a resumed run gives for the recipe's optimizer settings that differ (none: silent)."""
    if changes:
        log.warning("resumed with the recipe's optimizer settings (moments kept): %s", "; ".join(changes))


def apply_optimizer_settings(schedulers: list, built: list[list[dict]]) -> None:
    """After a checkpoint's optimizer and LR schedule loaded: every param group's settings as this
    run built them from the recipe (`built_settings`), its lr where the schedule stands (bit-equal
    to the saved one when nothing changed)."""
    for sched, groups in zip(schedulers, built):
        sched.base_lrs = [g["initial_lr"] for g in groups]
        for group, multiplier, own in zip(sched.optimizer.param_groups, sched.lr_lambdas, groups):
            group.update({**own, "lr": own["initial_lr"] * multiplier(sched.last_epoch)})
        sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
