"""Faults on purpose (`simulate.nan_at_step`, `simulate.hang_at_step`): for tests, and for users checking
that their set-up reports a bad loss or a frozen rank the way they expect."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class FaultInjection:
    """The faults of one rank (the assembly keeps `simulate`'s only where they name this rank)."""

    nan_at_step: int | None = None
    hang_at_step: int | None = None

    def applied(self, loss: Tensor, step: int) -> Tensor:
        """The loss of 1-based `step`, made NaN (so its gradients and parameters go bad too) or with the
        whole process frozen first, when this is the step to break."""
        if step == self.hang_at_step:
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, heartbeats included
        if step == self.nan_at_step:
            return loss * float("nan")
        return loss
