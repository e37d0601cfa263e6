"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH (before
tests/helpers/sample_log, whose hook it loads too): with $FLODL_TEST_KILL_IN_SAVE=R:E:WHEN, the first process
of rank R SIGKILLs itself at its sharded save of the checkpoint after epoch E (0-based): `before` it (its
group's others wait in the save's collectives) or `after` it (its group's save written, its part not)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).parent.parent / "sample_log" / "sitecustomize.py"))

_KILL = os.environ.get("FLODL_TEST_KILL_IN_SAVE")

if _KILL and os.environ.get("FLODL_INCARNATION", "0") == "0":
    import signal
    from typing import Any

    import flodl.worker.sharded_state as sharded_state

    _rank, _epoch, _when = _KILL.split(":")
    _write = sharded_state.write
    _point = f"epoch-{int(_epoch) + 1:06d}.partial"

    def _killed_write(state: dict[str, Any], path: Path) -> None:
        mine = os.environ.get("RANK") == _rank and _point in path.parts
        if mine and _when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        _write(state, path)
        if mine and _when == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    sharded_state.write = _killed_write  # type: ignore[assignment]
