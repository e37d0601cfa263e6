"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH: with
$FLODL_TEST_WRITE_DELAY_S set, every part a rank writes in the background for a checkpoint of epoch
$FLODL_TEST_WRITE_DELAY_FROM_EPOCH (0-based) or later waits that long on the writer's thread once the
checkpoint's `.partial` dir exists, so a test can kill the job while a save is in flight (the timing a slow
disk produces, forced)."""

from __future__ import annotations

import os

_DELAY_S = float(os.environ.get("FLODL_TEST_WRITE_DELAY_S", "0"))
_FROM_EPOCH = int(os.environ.get("FLODL_TEST_WRITE_DELAY_FROM_EPOCH", "0"))

if _DELAY_S > 0:
    import threading
    import time
    from typing import Any

    from flodl.checkpoints.disk import CheckpointDir

    _write_part = CheckpointDir.write_part

    def _delayed_write_part(self: CheckpointDir, point: Any, name: str, obj: object) -> None:
        held = point.epoch >= _FROM_EPOCH
        if held and threading.current_thread().name.startswith("flodl-checkpoint"):
            self.partial(point)
            time.sleep(_DELAY_S)
        _write_part(self, point, name, obj)

    CheckpointDir.write_part = _delayed_write_part  # type: ignore[method-assign]
