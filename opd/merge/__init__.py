"""opd.merge: search mergekit consolidations of experts and report what each candidate keeps.

Programmatic entry: `run_recipe(load_recipe("merge_recipes/lab.yaml", ["budget.n_trials=10"]))`.
"""

from opd.merge.recipe import MergeRecipe, load_recipe
from opd.merge.search import run_recipe

__all__ = ["MergeRecipe", "load_recipe", "run_recipe"]
