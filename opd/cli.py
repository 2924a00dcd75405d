"""The `opd` command: one entry point for every stage (each also has its own script or module form,
`python scripts/train_expert.py`, `python -m opd.merge`, ...; both forms run the same function)."""

from __future__ import annotations

import importlib
import sys

from opd import __version__

# In pipeline order: name -> (module:function, one line of help).
COMMANDS = {
    "lab": ("opd.lab.cli:lab_main", "the tiny lab end to end: base, experts, merge search and OPD, report"),
    "base": ("opd.lab.cli:base_main", "build the lab's base model (pre-training from scratch)"),
    "train-expert": ("opd.expert.cli:train_main", "train one capability expert with GSPO"),
    "distill": ("opd.distill.__main__:main", "one on-policy distillation run (experts as teachers)"),
    "merge": ("opd.merge.__main__:main", "search merges, OPD and hybrids with Optuna; score on test; report"),
    "export": ("opd.merge.__main__:export_main", "one searched candidate as mergekit YAML and a model"),
    "report": ("opd.merge.__main__:report_main", "render a finished merge run's report again"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:{width}}  {doc}" for name, (_, doc) in COMMANDS.items()]
    return ("usage: opd <command> [args ...]   (opd <command> --help for its options)\n\n"
            "Train RL capability experts, consolidate them, see what each candidate lost.\n\n"
            "commands, in pipeline order:\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0
    if argv[0] == "--version":
        print(f"opd {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose from {', '.join(COMMANDS)} (see opd --help)",
              file=sys.stderr)
        return 2
    module, fn = COMMANDS[name][0].split(":")
    getattr(importlib.import_module(module), fn)(rest, prog=f"opd {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
