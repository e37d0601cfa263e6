"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH: with
$FLODL_TEST_ROUND_DELAY_S set, the cpu backend's averaging round waits that long on its thread before it
reduces, so an async rank surely trains on while every round is in flight (the timing a loaded machine
produces now and then, forced)."""

from __future__ import annotations

import os

_DELAY_S = float(os.environ.get("FLODL_TEST_ROUND_DELAY_S", "0"))

if _DELAY_S > 0:
    import time
    from typing import Any

    from flodl.averaging.consensus import HostAverager

    _reduce = HostAverager._round

    def _delayed_round(self: HostAverager, *args: Any) -> None:
        time.sleep(_DELAY_S)
        _reduce(self, *args)

    HostAverager._round = _delayed_round  # type: ignore[method-assign]
