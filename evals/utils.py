"""lm-eval hooks for opd tasks: held-out items come from opd's capability registry."""

from opd.evaluation.heldout import load_dataset_dict, process_results

__all__ = ["load_dataset_dict", "process_results"]
