"""What import statements name, read with ast: for tests/unit/test_layers.py and tests/unit/test_repo.py."""

from __future__ import annotations

import ast


def names_imported_by(node: ast.AST, package: str) -> set[str]:
    """Every dotted name the import statement `node` brings in (with `from a import b`, both `a` and `a.b`);
    `package` anchors a relative import. Any other node imports nothing."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    return {base, *(f"{base}.{alias.name}" for alias in node.names)}
