"""opd.weights: weight-space merges of a base and its experts, below everything that merges.

- `merge`: a candidate (method + parameters) merged in memory or as a mergekit YAML, tensor for
  tensor the same; opd's own methods are registered with mergekit when it is imported.
- `subspace`: TSV-M, Iso-C and Iso-CTS as pure torch functions and mergekit methods.
- `regmean`: RegMean's least-squares merge and the Gram matrices it collects from lab prompts.
- `wudi`: WUDI's closed-form data-free merge, optionally with RegMean's Grams as a data term.
- `layers`: parameters searched per layer group, as mergekit settings.

The search's merge strategies (opd.merge.strategies) and a distillation student started from a
merge (opd.distill.run) both build weights here, so neither imports the other to merge.
"""
