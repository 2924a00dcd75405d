"""opd's own merge methods as strategies: the subspace merges TSV-M, Iso-C and Iso-CTS
(opd.weights.subspace), the data-aware RegMean (opd.weights.regmean) and WUDI (opd.weights.wudi).

They merge as mergekit's methods do (opd.weights registers them with mergekit), so each is a
`MergeStrategy`; a plain `mergekit-yaml` does not know them, so the best model's card says to
rebuild it with `python -m opd.merge export` instead.
"""

from __future__ import annotations

from opd.merge.strategies.mergekit_methods import MergeStrategy
from opd.weights.merge import methods

OPD_METHODS = [MergeStrategy.of(m) for m in methods() if not m.native]
