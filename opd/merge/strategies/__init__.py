"""opd.merge.strategies: every way the search can consolidate experts, one object each, in one registry.

- `base`: the interface the search and the report ask (`Strategy`), its inputs and context, the
  registry (`STRATEGIES`, `get_strategy`).
- `mergekit_methods`: mergekit's merge methods (`MergeStrategy`).
- `opd_methods`: opd's own merge methods (TSV-M, Iso-C, Iso-CTS, RegMean, WUDI), merged as mergekit's.
- `distill`: on-policy distillation from the base (`opd`), from the best merge (`merge_opd`), from a
  method's merge (`<method>+opd`), and its baselines (`offpolicy`, `gspo`).

Each family is registered here, in this order. The search (opd.merge.search) and the report know
strategies only through this registry; the weights they build come from opd.weights and opd.distill.
"""

from opd.merge.strategies.base import (
    RUNS_DIR,
    SEARCH_STAGE,
    STRATEGIES,
    BuildContext,
    MergeInputs,
    ModelCard,
    Strategy,
    get_strategy,
    merge_part,
    register,
    stages,
)
from opd.merge.strategies.distill import DISTILL_STRATEGIES, HYBRIDS, HYBRIDS_ARE
from opd.merge.strategies.mergekit_methods import MERGEKIT_METHODS
from opd.merge.strategies.opd_methods import OPD_METHODS

register(*MERGEKIT_METHODS, *OPD_METHODS, *DISTILL_STRATEGIES)
register(*HYBRIDS.values(), described_as=HYBRIDS_ARE)

__all__ = ["RUNS_DIR", "SEARCH_STAGE", "STRATEGIES", "BuildContext", "MergeInputs", "ModelCard", "Strategy", "get_strategy",
           "merge_part", "stages"]
