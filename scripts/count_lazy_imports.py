"""Count the imports that sit inside functions (opd's own, stdlib, third-party), and list those that
do not say why they are lazy.

    python scripts/count_lazy_imports.py [ROOT ...] [--list] [--missing]

A function-level import should be there for a reason (a heavy or optional dependency that a light
entry point must not load, or an import cycle): it says so in a `# lazy: <reason>` comment on its
line, or on a comment line right above it. tests/test_leaks.py holds opd/ to that.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = ("opd", "opd_kernels")
REASON = "# lazy:"


@dataclass(frozen=True)
class LazyImport:
    path: Path
    line: int
    end_line: int
    module: str  # the top-level package imported ("" for a relative import of opd's own)
    text: str
    reason: str | None  # the text after `# lazy:`, None when there is none

    @property
    def kind(self) -> str:
        if not self.module or self.module in OWN:
            return "own"
        return "stdlib" if self.module in sys.stdlib_module_names else "third-party"


def lazy_imports(path: Path) -> list[LazyImport]:
    """Every import statement inside a function (at any depth below it) of one file."""
    source = path.read_text()
    lines = source.splitlines()
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                module = child.names[0].name if isinstance(child, ast.Import) else ("" if child.level else child.module)
                span = lines[child.lineno - 1: child.end_lineno]
                above = lines[child.lineno - 2] if child.lineno > 1 else ""
                above = above if above.lstrip().startswith("#") else ""  # a comment line, not another import's
                reason = next((ln.split(REASON, 1)[1].strip() for ln in [*span, above] if REASON in ln), None)
                out.append(LazyImport(path, child.lineno, child.end_lineno, (module or "").split(".")[0],
                                      " ".join(s.strip() for s in span), reason))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(source, str(path)), False)
    return out


def collect(roots: list[Path]) -> list[LazyImport]:
    files = sorted(p for r in roots for p in ([r] if r.is_file() else r.rglob("*.py")))
    return [imp for p in files for imp in lazy_imports(p)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("roots", nargs="*", default=[str(ROOT / "opd")], help="files or directories (default opd/)")
    ap.add_argument("--list", action="store_true", help="print every function-level import")
    ap.add_argument("--missing", action="store_true", help="print those without a `# lazy:` reason")
    args = ap.parse_args(argv)
    found = collect([Path(r) for r in args.roots])
    for imp in found:
        if args.list or (args.missing and imp.reason is None):
            where = imp.path.resolve().relative_to(ROOT) if imp.path.resolve().is_relative_to(ROOT) else imp.path
            print(f"{where}:{imp.line}: {imp.text}" + (f"  [{imp.reason}]" if imp.reason else ""))
    kinds = Counter(i.kind for i in found)
    with_reason = sum(i.reason is not None for i in found)
    print(f"{len(found)} function-level imports: {kinds['own']} opd's own, {kinds['third-party']} third-party, "
          f"{kinds['stdlib']} stdlib; {with_reason} say why they are lazy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
