"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH: with
$FLODL_TEST_HOLD_COMMIT_DIR set, the first checkpoint commit of the process (on the coordinator's commit
thread) touches `commit-held` in that dir and waits there until `commit-release` appears, so a test can
have a stop requested while a scheduled checkpoint is still to be committed. It loads
tests/helpers/held_steps' hook too (a process loads one sitecustomize: the first on its path)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).parent.parent / "held_steps" / "sitecustomize.py"))

_DIR = os.environ.get("FLODL_TEST_HOLD_COMMIT_DIR")

if _DIR:
    import threading
    from typing import Any

    from flodl.checkpoints.disk import Checkpoint, CheckpointDir
    from tests.helpers.hold import hold_until_released

    _commit = CheckpointDir.commit
    _first = threading.Lock()

    def _held_commit(self: CheckpointDir, *args: Any, **kwargs: Any) -> Checkpoint:
        if _first.acquire(blocking=False):  # never released: only the first commit is held
            hold_until_released(Path(_DIR) / "commit-held", Path(_DIR) / "commit-release")
        return _commit(self, *args, **kwargs)

    CheckpointDir.commit = _held_commit  # type: ignore[method-assign]
