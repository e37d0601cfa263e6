"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH: with
$FLODL_TEST_HOLD_AT_STEP and $FLODL_TEST_HOLD_DIR set, a rank that has taken that many steps touches `held`
in that dir and waits there until `release` appears, so a test can send a stop signal while the run surely
has work left, and let it go on once the stop was taken. With $FLODL_TEST_HOLD_AFTER set, the hold begins at
the first such step once that path exists (a checkpoint the test waits for, whose commit needs the rank's
receipt: a rank held before it would hold the commit too). With $FLODL_TEST_STEP_S set, every step first
waits that long: the pace has a ceiling on any machine, so a sync stop's agreed step (two seconds of steps
ahead) stays within a short run."""

from __future__ import annotations

import os

_AT_STEP = int(os.environ.get("FLODL_TEST_HOLD_AT_STEP", "0"))
_DIR = os.environ.get("FLODL_TEST_HOLD_DIR")
_AFTER = os.environ.get("FLODL_TEST_HOLD_AFTER")
_STEP_S = float(os.environ.get("FLODL_TEST_STEP_S", "0"))

if (_AT_STEP and _DIR) or _STEP_S:
    import time
    from pathlib import Path
    from typing import Any

    from flodl.worker.stepper import Stepper
    from tests.helpers.hold import hold_until_released

    _step = Stepper.step

    def _held_step(self: Stepper, *args: Any, **kwargs: Any) -> Any:
        due = _AT_STEP and self.steps_total >= _AT_STEP and (_AFTER is None or Path(_AFTER).exists())
        if due and _DIR:
            hold_until_released(Path(_DIR) / "held", Path(_DIR) / "release")
        time.sleep(_STEP_S)
        return _step(self, *args, **kwargs)

    Stepper.step = _held_step  # type: ignore[method-assign]
