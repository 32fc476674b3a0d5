"""The optimizers a recipe names in optimizer.name: one file each, one line here to register.
Each builder takes the parameter groups, the parameters' names (by id) and [optimizer]."""

from __future__ import annotations

from . import adamw, lion, muon, sgd

OPTIMIZERS = {
    "adamw": adamw.build,
    "sgd": sgd.build,
    "lion": lion.build,
    "muon": muon.build,
}
