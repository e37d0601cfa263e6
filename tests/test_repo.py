"""The repository's own rules: its layout, the hooks a commit runs, tests that share only tests/helpers/."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_pre_commit_runs_ruff_check_ruff_format_and_mypy_from_the_venv() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert {hook["id"]: hook["entry"] for hook in hooks} == {
        "ruff-check": ".venv/bin/ruff check",
        "ruff-format": ".venv/bin/ruff format",
        "mypy": ".venv/bin/mypy",
    }


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, absolute (`from . import x` under tests/ is `tests.x`)."""
    package = ".".join(path.relative_to(REPO).parent.parts)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_test_module_imports_another() -> None:
    # What tests share lives in tests/helpers/: importing a test module runs its fixtures' module-level code
    # and ties one file's tests to another's names.
    tests = {".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "tests").glob("test_*.py")}
    found = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for name in sorted(imported_modules(path) & tests)
    ]
    assert found == [], "move what they share to tests/helpers/: " + "; ".join(found)


def test_the_root_holds_the_configs_the_package_and_the_entry_point() -> None:
    # The design card's layout: the configs a user edits at the top (the package installs them as flodl.conf).
    for entry in ("conf/config.yaml", "flodl/__init__.py", "train.py", "tests", "outputs/.gitignore"):
        assert (REPO / entry).exists(), entry
    # One copy: a leftover flodl/conf/ (an old layout's __pycache__) would shadow conf/ on import.
    assert not (REPO / "flodl" / "conf").exists(), "remove flodl/conf/: flodl's configs live in conf/"
