"""`python -m meshforge.cli RECIPE ...` is `run_recipe RECIPE ...` (sweeps launch points this way)."""

import sys

from meshforge.cli import run_recipe_main

sys.exit(run_recipe_main())
