"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH: with
$FLODL_TEST_ROUND_DELAY_S set, the cpu backend's averaging round waits that long on its thread before it
reduces, so an async rank surely trains on while every round is in flight (the timing a loaded machine
produces now and then, forced); with $FLODL_TEST_FINAL_STATE_DIR set, each local-SGD rank saves its model's
state there as `rank{R}.pt` when the run ends (after its last round)."""

from __future__ import annotations

import os

_DELAY_S = float(os.environ.get("FLODL_TEST_ROUND_DELAY_S", "0"))
_FINAL_STATE_DIR = os.environ.get("FLODL_TEST_FINAL_STATE_DIR")

if _DELAY_S > 0:
    import time
    from typing import Any

    from flodl.averaging.consensus import HostAverager

    _reduce = HostAverager._round

    def _delayed_round(self: HostAverager, *args: Any) -> None:
        time.sleep(_DELAY_S)
        _reduce(self, *args)

    HostAverager._round = _delayed_round  # type: ignore[method-assign]

if _FINAL_STATE_DIR:
    from pathlib import Path

    import torch

    from flodl.worker.local_sgd import LocalSgdWorker

    _on_done = LocalSgdWorker.on_done

    def _saving_on_done(self: LocalSgdWorker) -> None:
        _on_done(self)
        state = {k: v.detach().cpu().clone() for k, v in self.stepper.parts.model.state_dict().items()}
        torch.save(state, Path(_FINAL_STATE_DIR) / f"rank{self.rank}.pt")

    LocalSgdWorker.on_done = _saving_on_done  # type: ignore[method-assign]
