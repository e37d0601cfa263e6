"""The repository's own rules: the hooks a commit runs."""

from __future__ import annotations

import yaml

from tests.helpers.procs import REPO


def test_pre_commit_runs_ruff_check_ruff_format_and_mypy_from_the_venv() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert {hook["id"]: hook["entry"] for hook in hooks} == {
        "ruff-check": ".venv/bin/ruff check",
        "ruff-format": ".venv/bin/ruff format",
        "mypy": ".venv/bin/mypy",
    }
