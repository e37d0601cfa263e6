"""The configuration reference (docs/configuration.md) is what `python -m flodl.config.reference` writes
from the schema: every key, its default, the comment above it, the values the rules allow."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.config.reference import COMMAND
from tests.helpers.procs import PYTHON, REPO, run

COMMITTED = REPO / "docs" / "configuration.md"


@pytest.mark.multiproc
def test_the_committed_reference_is_what_the_command_writes(tmp_path: Path) -> None:
    written = tmp_path / "configuration.md"
    run([PYTHON, "-m", "flodl.config.reference", str(written)], cwd=tmp_path).check()
    assert COMMITTED.read_text() == written.read_text(), f"docs/configuration.md is stale: run `{COMMAND}`"
