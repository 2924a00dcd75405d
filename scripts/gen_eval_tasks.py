"""Regenerate evals/: one lm-eval task YAML per built-in capability and eval split."""

from opd.capabilities import list_capabilities
from opd.evaluation.tasks import REPO_EVALS, write_tasks

if __name__ == "__main__":
    caps = [c for c in list_capabilities() if not c.startswith("rg:")]
    write_tasks(REPO_EVALS, caps)
    print(f"wrote {len(caps) * 2} tasks to {REPO_EVALS}")
