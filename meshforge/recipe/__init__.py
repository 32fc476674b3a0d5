"""One place validates a recipe, by topic: `validate.py` loads it and runs every rule in one
pass (the order there), `own.py` the rules a recipe obeys on its own (choices, ranges, mesh
degrees against the world, batch arithmetic, data), `inert.py` the settings its own choices leave
unread, `model.py` the model's rules on the mesh, `optimizer.py` the optimizer's and its
settings', `combinations.py` those across sections.
The rules a model family or a parallelism owns live beside it (`ModelSpec.check`,
parallelisms' `check_*`); this package composes them."""

from .model import experts_of
from .validate import load_recipe, validate

__all__ = ["experts_of", "load_recipe", "validate"]
