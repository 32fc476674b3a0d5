"""meshforge.configs: the recipe schema (dataclasses, a module per section or group of them) and
the loader, which checks keys and types; every other rule is meshforge.recipe's. Imports nothing
of meshforge but meshforge.core."""

from meshforge.core.errors import Problem, RecipeError

from .activation_checkpoint import ACPolicy, ac_policy
from .loader import (
    RecipeLike,
    RecipeSource,
    embedded_recipes,
    load_config,
    read_config,
    recipe_to_dict,
    recipe_to_toml,
    resolve_recipe_path,
)
from .schema import Recipe, field_doc, sections

__all__ = [
    "ACPolicy",
    "ac_policy",
    "Problem",
    "RecipeError",
    "Recipe",
    "embedded_recipes",
    "field_doc",
    "load_config",
    "read_config",
    "RecipeLike",
    "RecipeSource",
    "recipe_to_dict",
    "recipe_to_toml",
    "resolve_recipe_path",
    "sections",
]
