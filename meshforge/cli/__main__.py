"""`python -m meshforge.cli RECIPE ...` is `run_recipe RECIPE ...` (sweeps launch points this way)."""

from meshforge.cli import run_recipe_program

run_recipe_program()
