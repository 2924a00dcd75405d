"""The ast walk over a file's imports that tests/test_layering.py and tests/test_leaks.py share."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """The dotted module a file under `root` is (a package's __init__.py is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def walk_imports(module: str, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, base, name) for every import of a file, at any depth of its code, relative ones resolved:
    `import a.b` gives (line, "a.b", None); `from a import b` gives (line, "a", "b")."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out += [(node.lineno, base, a.name) for a in node.names]
    return out
