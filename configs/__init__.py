"""meshforge.configs: the recipe schema (dataclasses), loader and validation."""

from .loader import Problem, RecipeError, load_recipe, recipe_to_dict, resolve_recipe_path
from .schema import Recipe, field_doc, sections

__all__ = ["Problem", "RecipeError", "Recipe", "load_recipe", "recipe_to_dict", "resolve_recipe_path",
           "field_doc", "sections"]
