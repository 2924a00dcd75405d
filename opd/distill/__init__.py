"""opd.distill: on-policy multi-teacher distillation (OPD) of capability experts into one student.

Programmatic entry: `distill(cfg, student, tokenizer, teachers, routes)`; a whole run from YAML:
`run_distill(load_run("run.yaml"))` or `python -m opd.distill run.yaml`.
"""

from opd.distill.config import DistillConfig, DistillRun, TeacherRef, load_run
from opd.distill.loop import DistillState, distill
from opd.distill.routing import prompt_mix, resolve_routes
from opd.distill.teachers import Teacher, embedded_teacher

__all__ = ["DistillConfig", "DistillRun", "DistillState", "Teacher", "TeacherRef", "distill", "embedded_teacher",
           "load_run", "prompt_mix", "resolve_routes"]
