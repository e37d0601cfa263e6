"""The repository's own rules: its layout, the hooks a commit runs, tests that share only tests/helpers/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from tests.helpers.imports import names_imported_by

REPO = Path(__file__).resolve().parents[2]


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
    return {
        name for node in ast.walk(ast.parse(path.read_text())) for name in names_imported_by(node, package)
    }


def test_no_test_module_imports_another() -> None:
    # What tests share lives in tests/helpers/: importing a test module runs its fixtures' module-level code
    # and ties one file's tests to another's names.
    tests = {".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "tests").rglob("test_*.py")}
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


# The house's measures (docs/architecture.md lists them for a reader's own check): rooms hold the modules,
# and no module or function grows past what a reader takes in at once.
TOP_MODULES_MAX = 6
MODULE_MAX_LINES = 400
FUNCTION_MAX_LINES = 80


def test_the_top_of_the_package_holds_the_commands_and_a_few_leaves() -> None:
    top = sorted(p.name for p in (REPO / "flodl").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= TOP_MODULES_MAX, f"flodl/ holds {top}: give new modules a room"


def test_no_module_or_function_of_the_package_is_past_the_house_measures() -> None:
    found = []
    for path in sorted((REPO / "flodl").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(REPO)
        if len(text.splitlines()) > MODULE_MAX_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_MAX_LINES:
                    found.append(f"{name}: {node.name} is {length} lines")
    assert not found, (
        f"split these (over {MODULE_MAX_LINES} lines a module, {FUNCTION_MAX_LINES} a function): {found}"
    )


# The front door: a README read in minutes, the manual in docs/ (one guide per topic).
README_MAX_LINES = 260
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> list[str]:
    """The lines of a markdown file outside its fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def relative_links(path: Path) -> list[tuple[str, str]]:
    """(file part, anchor) of every link in `path` that points inside the repository."""
    targets = [target for line in prose(path) for target in LINK.findall(line)]
    return [
        (target.partition("#")[0], target.partition("#")[2])
        for target in targets
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    anchors = set()
    for line in prose(path):
        if heading := re.match(r"^#{1,6}\s+(.*?)\s*$", line):
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-"))
    return anchors


def test_the_readme_stays_short() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to a guide in docs/"


def test_every_relative_link_of_the_docs_points_to_a_file_that_exists() -> None:
    missing = [
        f"{path.relative_to(REPO)}: {target}"
        for path in DOCS
        for target, _ in relative_links(path)
        if target and not (path.parent / target).exists()
    ]
    assert missing == []


def test_every_anchor_of_a_docs_link_names_a_heading_of_its_file() -> None:
    missing = []
    for path in DOCS:
        for target, anchor in relative_links(path):
            linked = path.parent / target if target else path
            if anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                missing.append(f"{path.relative_to(REPO)}: {target}#{anchor}")
    assert missing == []


def test_every_guide_is_linked_from_the_readme() -> None:
    linked = {(REPO / target).resolve() for target, _ in relative_links(REPO / "README.md") if target}
    guides = {path.resolve() for path in DOCS[1:]}
    assert sorted(p.name for p in guides - linked) == []
